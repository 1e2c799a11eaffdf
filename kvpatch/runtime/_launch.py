"""A part of the kvpatch runtime: Triton launches at low host cost (issue 17, eager host time).

Not a module of its own: kvpatch/runtime/__init__.py joins the parts in the order of its
PARTS into the one _kvpatch_runtime.py that apply injects, keeping only what follows the
"joined from here" line. The parts share that one module's namespace (a `global` in one
part rebinds a name another defines); the imports above the line only let a part read
alone, and are dropped.
"""

import torch

# -- joined from here --


# ---------------------------------------------------------------------------
# Kernel launches. Triton's own launch (kernel[grid](...)) binds and specialises every
# argument in Python on every call: tens of µs of host time, paid per layer per step in
# eager mode (prefill, batches above the graph capture sizes). After the first launch of
# a specialisation, _launch calls the compiled kernel's launcher directly, under a key
# holding everything the binary depends on: the kernel, its constexprs and options, the
# current device, each tensor's dtype and 16-byte alignment, each int's ==1 / %16 / 32-bit
# classes (a superset of Triton's own specialisation, so a key never names two binaries).

_launch_compiled = {}
_launch_triton = (
    None  # (triton.knobs.runtime, current device, current stream), on first use
)
_launch_idents = [0]
# The Triton releases whose CudaLauncher.__call__ this part reproduces (below): their C
# launch takes (grid x3, stream, function, cooperative, pdl, global scratch, profile
# scratch, packed metadata, launch metadata, enter hook, exit hook, *args). Any other
# release goes through the launcher object: correct, a little slower.
_LAUNCH_DIRECT_TRITON = ("3.6.",)


def _launch_ident(tag):
    """A fresh name for a caller's plan, never reused in this process (reset() drops plans,
    not compiled kernels: a launch key that names a plan must never name another)."""
    _launch_idents[0] += 1
    return (tag, _launch_idents[0])


def _launch_spec(a):
    """What Triton's binder specialises an argument on (key material, hashable)."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15)
    if t is int:
        return (a == 1, not a & 15, -0x80000000 <= a <= 0x7FFFFFFF)
    if t is bool or a is None:
        return (t, a)
    return t  # floats: fp32, never specialised on value


def _launch_driver():
    """(Triton's runtime knobs, current device, current stream), or False without a GPU driver."""
    try:
        import triton

        drv = triton.runtime.driver.active
        return (triton.knobs.runtime, drv.get_current_device, drv.get_current_stream)
    except Exception:
        return False


def _launch_direct(ck):
    """(C launch, cooperative flag, pdl flag) of a compiled kernel whose launcher can be
    skipped, else None. CudaLauncher.__call__ only allocates the scratch buffers that a
    kernel declares and then calls its C launch: with none declared, calling the C launch
    here saves that Python frame (about a µs a launch of eager host time)."""
    try:
        import triton

        if not triton.__version__.startswith(_LAUNCH_DIRECT_TRITON):
            return None
        launcher = ck.run  # a property: loads the binary and builds the launcher once
        if (
            type(launcher).__name__ != "CudaLauncher"
            or launcher.global_scratch_size
            or launcher.profile_scratch_size
        ):
            return None
        return (
            launcher.launch,
            launcher.launch_cooperative_grid,
            launcher.launch_pdl,
        )
    except Exception:
        return None


def _launch_listening(hook):
    """Whether a launch hook would run. Triton up to 3.5 leaves the knob None until a
    profiler sets a function; 3.6 always holds a HookChain, listening only once something
    is added to its calls (an empty chain must not send every launch down the slow path).
    """
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch(kernel, grid, args, consts, spec=None, ptr_args=None):
    """kernel[grid](*args, **dict(consts)); returns the compiled kernel.

    consts: a tuple of (name, value) items, the constexprs and launch options (hashable;
    a caller keeps one per configuration). spec: None, or the caller's own hashable key
    for everything the binary depends on besides the kernel and the device (constexprs,
    options, every argument's dtype, alignment and int classes), when it can vouch for
    them more cheaply than the per-argument key here. ptr_args: with spec, args with each
    CUDA tensor replaced by its data_ptr(), used once the binary is cached: the C launch
    takes an int as it is, where a tensor costs a method call and a driver query."""
    global _launch_triton
    if _launch_triton is None:
        _launch_triton = _launch_driver()
    if (
        not _launch_triton
        or _launch_listening(_launch_triton[0].launch_enter_hook)
        or _launch_listening(_launch_triton[0].launch_exit_hook)
    ):
        # No GPU driver (Triton's interpreter), or a profiler listens: Triton's own path.
        return kernel[grid](*args, **dict(consts))
    hooks, current_device, current_stream = _launch_triton
    dev = current_device()
    if spec is None:
        key = (kernel, dev, consts, tuple([_launch_spec(a) for a in args]))
    else:
        key = (kernel, dev, spec)
    hit = _launch_compiled.get(key)
    if hit is None:
        ck = kernel[grid](*args, **dict(consts))
        if hasattr(ck, "packed_metadata"):  # not the interpreter
            named = dict(consts)
            _launch_compiled[key] = (
                ck,
                tuple(named[n] for n in kernel.arg_names[len(args) :]),
                _launch_direct(ck),
            )
        return ck
    ck, tail, direct = hit
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    if spec is not None and ptr_args is not None:
        args = ptr_args
    if direct is not None:
        launch, cooperative, pdl = direct
        try:
            launch(
                grid[0],
                g1,
                g2,
                current_stream(dev),
                ck.function,
                cooperative,
                pdl,
                None,
                None,
                ck.packed_metadata,
                None,
                None,
                None,
                *args,
                *tail,
            )
            return ck
        except TypeError:
            # Arguments refused before any launch (a launcher this part does not know
            # after all): the launcher object from now on.
            _launch_compiled[key] = (ck, tail, None)
    ck.run(
        grid[0],
        g1,
        g2,
        current_stream(dev),
        ck.function,
        ck.packed_metadata,
        None,
        None,
        None,
        *args,
        *tail,
    )
    return ck
