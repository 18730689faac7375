// kernels/prefill_state.cu — the two scalar updates around a prefill, done on the GPU.
//
//   prefill_begin_chunk   prefill_state = (start, n_rows)               before each prompt chunk
//   decode_resume         state = (pos, next_token[0], pos + 1)         after the prompt's last chunk
//
// Why kernels for two stores: the prefill kernels read (start, n_rows) from device memory, so
// one launch list per chunk size serves every chunk; and the decode step reads (pos, token,
// seq_len) from device memory (decode_state.cu). Writing them with a copy from the host would
// have to wait for the stream (the host buffer must outlive an async copy, and a synchronous
// copy waits for every queued kernel); a one-thread kernel with the values as launch
// arguments is ordered on the stream like everything else, and the host never waits.
// decode_resume takes the first generated token from next_token (written by the argmax or the
// sampler after prefill's lm_head), so decoding starts without the token visiting the host.
//
// Work split: one thread each. Bytes per call: 8 and 16. The limit: launch latency (~2 µs).
#include "types.cuh"

// grid (1), block (1).
extern "C" __global__ void prefill_begin_chunk(int* __restrict__ prefill_state,  // [2] int32, out: start, n_rows
                                               int start, int n_rows) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        prefill_state[0] = start;
        prefill_state[1] = n_rows;
    }
}

// grid (1), block (1).
extern "C" __global__ void decode_resume(int* __restrict__ state,             // [3] int32, out: pos, token, seq_len
                                         const int* __restrict__ next_token,  // [1] int32: the chosen token
                                         int pos) {                           // the first position to decode
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        state[0] = pos;
        state[1] = next_token[0];
        state[2] = pos + 1;
    }
}
