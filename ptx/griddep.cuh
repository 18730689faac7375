// ptx/griddep.cuh — programmatic dependent launch (PDL), the device side.
//
//   grid_dependency_wait      griddepcontrol.wait               (PTX ISA, "Parallel Synchronization and
//   grid_launch_dependents    griddepcontrol.launch_dependents   Communication Instructions: griddepcontrol")
//
// A kernel launched with programmatic stream serialization (KernelLaunch(programmatic=True),
// src/drvqwen/cuda/launch.py) may start while the kernel before it on the stream is still
// running. griddepcontrol.wait blocks until every prerequisite grid has completed and its
// memory operations are visible; everything before it overlaps the previous kernel's tail. In
// the decode step that is where the weight loads go: no kernel writes weights, so a GEMV can
// have its first bytes in flight before the kernel that produces its input has finished.
// Rule for every kernel that includes this header: before grid_dependency_wait(), read only
// data no kernel of the step writes (weights, tensor maps), and write nothing.
//
// griddepcontrol.launch_dependents lets the next kernel be scheduled once every block of this
// one has executed it (or exited); issued at the start of a kernel whose blocks all fit in one
// wave, the next kernel's blocks take SM slots as this kernel's blocks retire.
//
// Launched without the attribute (or eagerly, without a programmatic predecessor), both are
// no-ops: the same cubin serves both ways.
//
// The wait carries a "memory" clobber, so the compiler keeps every ordinary load and store
// after it. Our inline-asm loads (ptx/ldst.cuh) are not volatile and name no memory, which lets
// the compiler hoist them freely — right for weights, wrong for activations: after the wait,
// read what an earlier kernel wrote with ordinary C++ loads, never with those wrappers.
#pragma once

__device__ __forceinline__ void grid_dependency_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// No memory clobber: loads may be scheduled before or after it freely.
__device__ __forceinline__ void grid_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;");
}
