"""The block-uniform wait check (``ptx_sync``) on hand-written PTX: it flags the barrier and the elected
store of a wait that each warp leaves on its own (the QK norm's wait before it became block-wide: a
per-warp shuffle and a per-thread clock), passes the same wait decided through shared memory, and takes
a per-thread spin in inline asm (scoped labels and registers, no barrier) as allowed."""

from tests.support import ptx_sync

HEAD = """
.visible .entry wait_kernel(
	.param .u64 wait_kernel_param_0
)
.reqntid 256, 1, 1
{
	.reg .pred 	%p<10>;
	.reg .b32 	%r<30>;
	.reg .b64 	%rd<20>;
	mov.u32 	%r1, %tid.x;
	and.b32 	%r20, %r1, 31;
	shr.u32 	%r21, %r1, 5;
	or.b32 	%r22, %r20, %r21;
	setp.eq.b32 	%p1, %r22, 0;
	setp.eq.b32 	%p5, %r20, 0;
	ld.param.u64 	%rd1, [wait_kernel_param_0];
	mov.u64 	%rd2, %globaltimer;
"""

#: Each warp ORs its own copy of a narrow tile (a shuffle, no shared memory) and reads its own clock; the
#: abort store's barrier and the elected release sit under the per-thread clock test.
PER_WARP = HEAD + """
$L__BB0_1:
	ld.volatile.global.b32 	%r2, [%rd1];
	shfl.sync.bfly.b32 	%r3, %r2, 1, 31, -1;
	or.b32 	%r4, %r2, %r3;
	mov.u64 	%rd3, %globaltimer;
	sub.s64 	%rd4, %rd3, %rd2;
	setp.lt.s64 	%p2, %rd4, 1000;
	@%p2 bra 	$L__BB0_3;
	bar.sync 	0;
	@%p1 red.global.sys.release.or.b64 [%rd1], %rd4;
$L__BB0_3:
	setp.ne.s32 	%p3, %r4, 0;
	@%p3 bra 	$L__BB0_1;
	@%p1 st.global.b32 [%rd1], %r4;
	ret;
}
"""

#: The same wait with each round's code ORed over the program through shared memory (as
#: ``sync.block_code`` compiles): every branch decides on the value read back after the barrier.
BLOCK_WIDE = HEAD + """
	mov.b32 	%r10, global_smem;
	shl.b32 	%r11, %r21, 2;
	add.s32 	%r12, %r10, %r11;
	shl.b32 	%r13, %r20, 2;
	add.s32 	%r14, %r10, %r13;
$L__BB0_1:
	ld.volatile.global.b32 	%r2, [%rd1];
	mov.u64 	%rd3, %globaltimer;
	sub.s64 	%rd4, %rd3, %rd2;
	setp.lt.s64 	%p2, %rd4, 1000;
	selp.b32 	%r5, 0, 16, %p2;
	or.b32 	%r6, %r2, %r5;
	redux.sync.or.b32 	%r7, %r6, -1;
	@%p5 st.shared.b32 	[%r12], %r7;
	bar.sync 	0;
	ld.shared.b32 	%r8, [%r14];
	redux.sync.or.b32 	%r9, %r8, -1;
	and.b32 	%r15, %r9, 16;
	setp.eq.s32 	%p3, %r15, 0;
	@%p3 bra 	$L__BB0_3;
	bar.sync 	0;
	@%p1 red.global.sys.release.or.b64 [%rd1], %rd4;
$L__BB0_3:
	and.b32 	%r16, %r9, 3;
	setp.ne.s32 	%p4, %r16, 0;
	@%p4 bra 	$L__BB0_1;
	@%p1 st.global.b32 [%rd1], %r9;
	ret;
}
"""

#: Two per-thread spins in inline asm (the Lamport vector wait's shape): each thread polls and gives up on
#: its own, with labels and registers of the same names in each asm block and no barrier inside; the
#: barrier after them is reached once by every thread.
ASM_SPINS = HEAD + """
	{
	.reg .pred %pm;
	.reg .b32 %h;
	SPIN:
	ld.volatile.global.b32 %h, [%rd1];
	setp.eq.u32 %pm, %h, 32768;
	@%pm bra SPIN;
	mov.b32 %r2, %h;
	}
	{
	.reg .pred %pm;
	.reg .b32 %h;
	SPIN:
	ld.volatile.global.b32 %h, [%rd1+4];
	setp.eq.u32 %pm, %h, 32768;
	@%pm bra SPIN;
	mov.b32 %r3, %h;
	}
	bar.sync 	0;
	@%p1 st.global.b32 [%rd1], %r3;
	ret;
}
"""


def test_a_wait_each_warp_leaves_on_its_own_is_flagged():
    found = ptx_sync.analyse(PER_WARP)
    kinds = {(v.kind, v.text.split()[0]) for v in found}
    assert ("barrier", "bar.sync") in kinds
    assert ("elected store", "@%p1") in kinds  # the release of the abort store
    assert all("st.global.b32 [%rd1], %r4" not in v.text for v in found)  # after the loop: reached by all
    assert [(uniform, barrier) for _, uniform, barrier in ptx_sync.wait_loops(PER_WARP)] == [(False, True)]


def test_the_same_wait_decided_through_shared_memory_passes():
    assert ptx_sync.analyse(BLOCK_WIDE) == []
    assert [(uniform, barrier) for _, uniform, barrier in ptx_sync.wait_loops(BLOCK_WIDE)] == [(True, True)]


def test_per_thread_spins_in_inline_asm_pass():
    assert ptx_sync.analyse(ASM_SPINS) == []
    loops = ptx_sync.wait_loops(ASM_SPINS)
    assert [(uniform, barrier) for _, uniform, barrier in loops] == [(False, False), (False, False)]


def test_a_barrier_under_a_branch_on_a_polled_word_is_flagged():
    bad = ASM_SPINS.replace("\tbar.sync \t0;\n", "\tsetp.eq.u32 \t%p6, %r3, 1;\n\t@%p6 bra \t$L__BB0_9;\n"
                            "\tbar.sync \t0;\n$L__BB0_9:\n")
    assert bad != ASM_SPINS
    assert [v.kind for v in ptx_sync.analyse(bad)] == ["barrier"]
