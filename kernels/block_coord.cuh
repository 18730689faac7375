// kernels/block_coord.cuh — which block of which grid a piece of work is, and how it waits for
// its inputs: the same device function serves a kernel launch of its own and one item of the
// persistent decode step (decode_persistent.cu).
//
//   BlockCoord   the block's coordinates in the grid its work was planned for (the launch's own
//                grid, or the planned grid of the launch the persistent step stands in for) and
//                the block size that plan gave it. Work splits and reduction orders are computed
//                from these, never from blockIdx / gridDim / blockDim directly, so a block of the
//                persistent kernel that runs "block 17 of 224, 7 warps" adds up exactly what block
//                17 of that launch adds up, in the same order: graph == eager bit for bit.
//   GridDep      the kernel launch's way to wait: programmatic dependent launch (ptx/griddep.cuh).
//                The persistent step has its own (CounterDep, decode_persistent.cu): wait for the
//                producers' completion counters in global memory.
//
// A device function that takes a `Dep` calls dep.launch_dependents() where the launch would
// call griddepcontrol.launch_dependents and dep.wait() where it would call griddepcontrol.wait,
// from every thread of the block: reads of an earlier step's output come after dep.wait().
#pragma once

#include "griddep.cuh"  // grid_dependency_wait, grid_launch_dependents

struct BlockCoord {
    int bx, by;   // block index in the planned grid (x, y)
    int gx;       // planned grid size along x
    int threads;  // planned block size (threads; a multiple of 32, ≤ blockDim.x)

    // The coordinates of the running launch itself.
    __device__ static __forceinline__ BlockCoord of_launch() {
        return BlockCoord{(int)blockIdx.x, (int)blockIdx.y, (int)gridDim.x, (int)blockDim.x};
    }
};

struct GridDep {
    // Whether the step's state and block table stay fixed while this block runs, so they may be
    // read before wait(): not for a launch, whose predecessor may still be running (PDL: the
    // kernel before it may itself not have waited yet for advance_state of the last step).
    static constexpr bool state_fixed = false;
    // Whether the running block has exactly the planned block's bc.threads threads: a launch's
    // does; a persistent block may have more, whose extra warps must take no work.
    __device__ static constexpr bool exact_block() { return true; }
    __device__ __forceinline__ void wait() const { grid_dependency_wait(); }
    __device__ __forceinline__ void launch_dependents() const { grid_launch_dependents(); }
};
