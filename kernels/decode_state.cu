// kernels/decode_state.cu — the per-step decode state, advanced on the GPU.
//
//   advance_state           state[1] = next_token[0]; state[0] += 1; state[2] += 1
//   advance_state_tokens    state[1] = next_token[T-1]; state[0] += T; state[2] += T   (the verify pass)
//   set_block_table_entry   block_table[state[0] / 16] = new_page[0]   (first node of the page-opening step)
//
// state is the int32 [3] device array every decode kernel reads instead of taking launch
// arguments: state[0] = pos (position of the token decoded now; its K/V is written there),
// state[1] = current input token id, state[2] = seq_len = pos + 1 (valid KV positions after
// this step's write). Running this as the last node of the decode graph lets the graph chain
// steps with no host round trip: the argmax output becomes the next step's input token.
//
// Both wait for their predecessor (griddepcontrol.wait, ptx/griddep.cuh): they are launched as
// programmatic dependents like the rest of the step.
// The verify pass of speculative decoding runs T tokens at positions pos … pos+T-1 and ends with
// advance_state_tokens: the state T decode steps would leave, the token the argmax chose after
// the last of them included. The host rolls it back to the accepted count (sequence.py); as a
// kernel that reads the position from the state, it keeps the pass's launches free of
// per-pass arguments, the way the decode step's are.
//
// Work split: one thread each. Bytes per call: 16 (advance_state, advance_state_tokens), 12
// (set_block_table_entry).
// The limit: each is one graph node (~1 µs of dependency latency); advance_state may later
// be folded into argmax_final.
#include "types.cuh"
#include "griddep.cuh"   // grid_dependency_wait, grid_launch_dependents
#include "kv_cache.cuh"  // PAGE_TOKENS

// grid (1), block (1).
extern "C" __global__ void advance_state(int* __restrict__ state,             // [3] int32, in/out
                                         const int* __restrict__ next_token) { // [1] int32
    grid_launch_dependents();
    grid_dependency_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        state[1] = next_token[0];
        state[0] += 1;
        state[2] += 1;
    }
}

// grid (1), block (1).
extern "C" __global__ void advance_state_tokens(int* __restrict__ state,              // [3] int32, in/out
                                                const int* __restrict__ next_token,   // [T] int32
                                                int n_tokens) {                       // T
    grid_launch_dependents();
    grid_dependency_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        state[1] = next_token[n_tokens - 1];
        state[0] += n_tokens;
        state[2] += n_tokens;
    }
}

// The "opens_page" graph (src/drvqwen/graphs.py) is the decode step that opens a new KV page:
// this kernel runs first and records the page the host popped from its free list in the block
// table, so the QKV kernel (which writes K/V) and attention of the same step already see it.
// The host never edits the graph: it copies the page id into the device scalar new_page (an
// async 4-byte copy queued on the stream just before the graph's launch), and the logical page
// comes from the device state, which is where the graph keeps the position.
//
// grid (1), block (1).
extern "C" __global__ void set_block_table_entry(int* __restrict__ block_table,   // [n_pages] int32, out
                                                 const int* __restrict__ new_page, // [1] int32
                                                 const int* __restrict__ state,    // [3] int32
                                                 int n_pages) {
    grid_launch_dependents();
    grid_dependency_wait();
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const int logical = state[0] / PAGE_TOKENS;
        // The host checks the context bound before it picks B; this guard only keeps a host
        // bug from turning into a write past the table.
        if (logical < n_pages) block_table[logical] = new_page[0];
    }
}
