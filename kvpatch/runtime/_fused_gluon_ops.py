"""A part of the kvpatch runtime: the device functions of the Gluon split kernel (issue 17):
q's operand and the staged FP8 tiles read as the MMA operands. The kernel is the next part,
_fused_gluon.

Not a module of its own: kvpatch/runtime/__init__.py joins the parts (see there); nothing
above the "joined from here" line is kept.
"""

# -- joined from here --


def _fused_gluon_build_ops(gluon, gl):
    """Define the Gluon kernel's device functions as module globals (a kernel's callees are
    resolved in its module). The layouts they convert to are checked at compile time:
    assert_trivial fails the build if any of them would move data between threads."""
    global _fg_perm, _fg_q3, _fg_k3, _fg_pe3, _fg_v3

    @gluon.jit
    def _fg_perm(k):
        # Logical latent dim k -> its byte in the row: in each 16-wide group the QK
        # operand's registers k+1 and k+8 become a thread's adjacent bytes.
        return (
            (k & ~15)
            | (((k >> 2) & 1) << 3)
            | (((k >> 1) & 1) << 2)
            | (((k >> 3) & 1) << 1)
            | (k & 1)
        )

    @gluon.jit
    def _fg_q3(
        base,
        stride_h,
        col0,
        W: gl.constexpr,
        STEP: gl.constexpr,
        q_mul,
        A3: gl.constexpr,
    ):
        # q's [4, 16, W] operand: warp w's W dims from col0 + STEP w, permuted as K's.
        w = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, A3)))
        h = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, A3)))
        k = _fg_perm(gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, A3))))
        col = (col0 + STEP * w)[:, None, None] + k[None, None, :]
        x = gl.load(base + h[None, :, None] * stride_h + col).to(gl.float32)
        return (x * q_mul).to(gl.float16)

    @gluon.jit
    def _fg_k3(t, B3: gl.constexpr, BN: gl.constexpr, W: gl.constexpr):
        # [4 chunks, BN rows, W bytes] as loaded -> [4, W dims (logical), BN]: no movement.
        t = t.to(gl.float16).permute([0, 2, 1])
        t = t.reshape([4, W // 16, 2, 2, 2, 2, BN]).permute([0, 1, 4, 2, 3, 5, 6])
        return gl.convert_layout(t.reshape([4, W, BN]), B3, assert_trivial=True)

    @gluon.jit
    def _fg_pe3(t, B3: gl.constexpr, BN: gl.constexpr):
        # [BN rows, 64 rope bytes] (warp w: bytes 16 w..) -> [4, 16 dims (logical), BN].
        t = t.to(gl.float16).reshape([BN, 4, 16]).permute([1, 2, 0])
        t = t.reshape([4, 1, 2, 2, 2, 2, BN]).permute([0, 1, 4, 2, 3, 5, 6])
        return gl.convert_layout(t.reshape([4, 16, BN]), B3, assert_trivial=True)

    @gluon.jit
    def _fg_v3(t, B3: gl.constexpr, BN: gl.constexpr):
        # Physical latent column 32 b + 4 i + a -> the MMA's logical column 32 b + 8 a + i.
        t = t.to(gl.float16).reshape([4, BN, 4, 8, 4]).permute([0, 1, 2, 4, 3])
        return gl.convert_layout(t.reshape([4, BN, 128]), B3, assert_trivial=True)
