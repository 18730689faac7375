// kernels/decode_state.cu — advance the per-step decode state on the GPU.
//
//   advance_state   state[1] = next_token[0]; state[0] += 1; state[2] += 1
//
// state is the int32 [3] device array every decode kernel reads instead of taking launch
// arguments: state[0] = pos (position of the token decoded now; its K/V is written there),
// state[1] = current input token id, state[2] = seq_len = pos + 1 (valid KV positions after
// this step's write). Running this as the last node of the decode graph lets the graph chain
// steps with no host round trip: the argmax output becomes the next step's input token.
//
// Work split: one thread. Bytes per call: 16. The limit: it is one graph node (~1 µs of
// dependency latency); it may later be folded into argmax_final.
#include "types.cuh"

// grid (1), block (1).
extern "C" __global__ void advance_state(int* __restrict__ state,             // [3] int32, in/out
                                         const int* __restrict__ next_token) { // [1] int32
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        state[1] = next_token[0];
        state[0] += 1;
        state[2] += 1;
    }
}
