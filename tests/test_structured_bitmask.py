"""The grammar mask applied to a batch of logits (structured/bitmask.py) against a plain
reference: each masked row keeps exactly its allowed tokens, other rows are untouched. The
Triton kernel (the one CUDA uses) runs on the CPU under TRITON_INTERPRET=1 (set in conftest)."""
import pytest
import torch

pytest.importorskip("xgrammar", reason="xgrammar is not installed")

from nanovllm.structured.bitmask import TokenBitmask  # noqa: E402


def host_bitmask(allowed: set[int], vocab: int) -> torch.Tensor:
    """The int32 [1, ceil(vocab / 32)] bitmask of `allowed`, built bit by bit."""
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]], dtype=torch.int32)


VOCAB, ROWS = 77, 5  # not a multiple of 32: the last word is partial
ALLOWED = {1: {0, 5, 31, 32, 76}, 3: set(range(40, 77)), 4: {63}}


def reference(logits: torch.Tensor) -> torch.Tensor:
    expected = logits.clone()
    for r, a in ALLOWED.items():
        for t in range(VOCAB):
            if t not in a:
                expected[r, t] = float("-inf")
    return expected


def batch() -> tuple[torch.Tensor, TokenBitmask]:
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    return logits, TokenBitmask.from_rows(ROWS, [(r, host_bitmask(a, VOCAB)) for r, a in ALLOWED.items()], "cpu")


@pytest.mark.parametrize("backend", ["auto", "torch_native"])
def test_mask_keeps_allowed_tokens_of_constrained_rows_only(backend):
    logits, mask = batch()
    expected = reference(logits)
    mask.backend = backend
    mask.apply_(logits)
    assert torch.equal(logits, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernel on CPU tensors under TRITON_INTERPRET=1; "
                    "with a CUDA device, test_staging_builds_the_batch_mask_step_after_step runs it there")
def test_triton_kernel_matches_reference():
    """xgrammar's Triton kernel (CUDA's backend), launched as its wrapper does, but on the CPU:
    the wrapper itself asks torch.cuda for the SM count."""
    pytest.importorskip("triton", reason="triton is not installed")
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_kernel

    logits, mask = batch()
    expected = reference(logits)
    indices = torch.tensor(mask.rows, dtype=torch.int32)
    block = 64
    bitmask = mask.per_row()
    apply_token_bitmask_inplace_kernel[(2,)](logits, bitmask, indices, len(mask.rows), VOCAB,
                                             logits.stride(0), bitmask.stride(0), 2, block)
    assert torch.equal(logits, expected)


def test_no_constrained_row_means_no_mask():
    assert TokenBitmask.from_rows(3, [], "cpu") is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="BitmaskStaging builds masks on a CUDA device")
def test_staging_builds_the_batch_mask_step_after_step():
    """Through its reused pinned buffers, each step's mask keeps exactly that step's allowed
    tokens (a larger batch grows the buffers; a later step's rows replace the earlier ones)."""
    from nanovllm.structured.bitmask import BitmaskStaging

    staging = BitmaskStaging("cuda")
    steps = [ALLOWED, {0: {3, 4}, 2: {70}}, {r: {r % VOCAB, (3 * r) % VOCAB} for r in range(0, 200, 2)}]
    for allowed in steps:
        rows = max(allowed) + 1
        logits = torch.randn(rows, VOCAB, device="cuda")
        expected = logits.clone()
        for r, a in allowed.items():
            expected[r, [t for t in range(VOCAB) if t not in a]] = float("-inf")
        staging.build(rows, [(r, host_bitmask(a, VOCAB)) for r, a in allowed.items()]).apply_(logits)
        assert torch.equal(logits, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="BitmaskStaging builds masks on a CUDA device")
def test_staging_of_rows_of_one_table_keeps_each_rows_mask():
    """The engine's masks are rows of its one mask table, in the table's order, not the batch's
    (engine/grammars.py); each batch row must still get its own sequence's mask."""
    from nanovllm.structured.bitmask import BitmaskStaging

    allowed = {r: {r % VOCAB, (5 * r + 1) % VOCAB} for r in range(6)}
    table = torch.cat([host_bitmask(allowed[r], VOCAB) for r in range(6)])
    batch_of_table_row = {0: 4, 1: 0, 3: 5, 4: 2}  # batch row -> its sequence's table row; row 2 unconstrained
    masks = [(b, table[t : t + 1]) for b, t in batch_of_table_row.items()]
    logits = torch.randn(5, VOCAB, device="cuda")
    expected = logits.clone()
    for b, t in batch_of_table_row.items():
        expected[b, [v for v in range(VOCAB) if v not in allowed[t]]] = float("-inf")
    BitmaskStaging("cuda").build(5, masks).apply_(logits)
    assert torch.equal(logits, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="BitmaskStaging builds masks on a CUDA device")
def test_staging_of_rows_of_a_pinned_table_across_steps():
    """The engine's pinned table (engine/grammars.py), copied as it is: each step's batch rows get
    their sequences' rows as filled for that step, unconstrained rows are left alone, and a
    table refilled after a step's tokens came back gives the new masks."""
    from nanovllm.structured.bitmask import BitmaskStaging

    staging = BitmaskStaging("cuda")
    table = torch.zeros(8, host_bitmask(set(), VOCAB).shape[1], dtype=torch.int32).pin_memory()
    for step in range(3):
        allowed = {t: {(t + step) % VOCAB, (7 * t + 3 * step + 1) % VOCAB} for t in range(8)}
        for t in range(8):
            table[t] = host_bitmask(allowed[t], VOCAB)[0]
        batch_of_table_row = {0: (2 + step) % 8, 2: 7, 3: (5 * step) % 8}  # rows 1 and 4: no grammar
        logits = torch.randn(5, VOCAB, device="cuda")
        expected = logits.clone()
        for b, t in batch_of_table_row.items():
            expected[b, [v for v in range(VOCAB) if v not in allowed[t]]] = float("-inf")
        staging.build(5, [(b, table[t : t + 1]) for b, t in batch_of_table_row.items()]).apply_(logits)
        assert torch.equal(logits, expected)
        torch.cuda.synchronize()  # the engine refills only once the step's tokens are back
