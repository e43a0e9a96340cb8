"""Each transform on its worked example, plus composition and dense cross-checks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_dcr.layout.transforms import (
    BlockSplit,
    Compose,
    InterleavedRowSplit,
    Rename,
    ShardDim,
    Transpose,
    Truncate,
    chain,
)


def _only(res):
    assert len(res) == 1
    return res.pieces[0]


def test_shard_dim_example():
    p = _only(ShardDim((8, 4), 0, 2, 1, "w").remap(torch.tensor([5])))
    assert p.name == "w" and p.index.tolist() == [21]


def test_shard_dim_matches_chunk_for_3d():
    full = torch.arange(4 * 6 * 5).view(4, 6, 5)
    for dim in range(3):
        parts = full.shape[dim] // (2 if full.shape[dim] % 2 == 0 else 5)
        for rank in range(parts):
            local = full.chunk(parts, dim)[rank].reshape(-1)
            p = _only(ShardDim(tuple(full.shape), dim, parts, rank).remap(torch.arange(local.numel())))
            assert torch.equal(p.index, local)


def test_transpose_example_and_dense():
    assert _only(Transpose(2, 3).remap(torch.tensor([4]))).index.tolist() == [3]
    m = torch.arange(12).view(3, 4)
    got = _only(Transpose(3, 4).remap(torch.arange(12))).index
    assert torch.equal(m.t().reshape(-1)[got], torch.arange(12))


def test_truncate_drops_padding():
    res = Truncate(6, "emb").remap(torch.tensor([7, 5, 6, 0]))
    p = _only(res)
    assert p.selection.tolist() == [1, 3] and p.index.tolist() == [5, 0]
    assert len(Truncate(6).remap(torch.tensor([9]))) == 0


def test_qkv_split_docstring_example():
    split = InterleavedRowSplit(2, (2, 1, 1), 3, ("q", "k", "v"))
    p = _only(split.remap(torch.tensor([19])))
    assert p.name == "k" and p.index.tolist() == [4]
    p = _only(split.remap(torch.tensor([16])))  # row 5 = q3
    assert p.name == "q" and p.index.tolist() == [10]


def test_interleaved_split_dense_cross_check():
    groups, sizes, cols = 3, (4, 2, 2), 5
    parts = [torch.arange(groups * s * cols).view(groups * s, cols) + 1000 * k
             for k, s in enumerate(sizes)]
    fused = torch.cat([p.view(groups, s, cols) for p, s in zip(parts, sizes)], 1).reshape(-1)
    res = InterleavedRowSplit(groups, sizes, cols, ("a", "b", "c")).remap(torch.arange(fused.numel()))
    assert res.names() == ["a", "b", "c"] and res.numel() == fused.numel()
    for k, piece in enumerate(res):
        assert torch.equal(fused[piece.selection] - 1000 * k, piece.index)


def test_block_split_many_parts_uses_sort_path():
    names = tuple(f"e{i}" for i in range(7))
    idx = torch.tensor([13, 0, 2, 6, 1, 13])
    res = BlockSplit(2, names).remap(idx)
    assert res.names() == ["e0", "e1", "e3", "e6"]
    got = {p.name: (p.selection.tolist(), p.index.tolist()) for p in res}
    assert got["e0"] == ([1, 4], [0, 1]) and got["e6"] == ([0, 5], [1, 1])


def test_compose_routes_and_inherits_names():
    t = Compose(BlockSplit(4, ("x", "y")), (("y", Rename("Y")),))
    res = t.remap(torch.tensor([5, 1]))
    assert res.names() == ["x", "Y"]
    t2 = chain(ShardDim((4, 2), 0, 2, 1), Truncate(7, "w"))
    p = _only(t2.remap(torch.tensor([0, 1, 2])))
    assert p.name == "w" and p.selection.tolist() == [0, 1, 2] and p.index.tolist() == [4, 5, 6]
    assert len(t2.remap(torch.tensor([3]))) == 0


def test_empty_input():
    t = chain(ShardDim((4, 2), 0, 2, 1), InterleavedRowSplit(1, (1, 1), 2, ("g", "u")))
    assert len(t.remap(torch.zeros(0, dtype=torch.int64))) == 0


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(1, 6), parts=st.integers(1, 4), data=st.data())
def test_shard_then_transpose_is_a_permutation(rows, cols, parts, data):
    rank = data.draw(st.integers(0, parts - 1))
    full = (rows * parts, cols)
    t = chain(ShardDim(full, 0, parts, rank), Transpose(*full))
    idx = torch.arange(rows * cols)
    p = _only(t.remap(idx))
    dense = torch.arange(full[0] * full[1]).view(full).t().reshape(-1)
    local = torch.arange(full[0] * full[1]).view(full).chunk(parts, 0)[rank].reshape(-1)
    assert torch.equal(dense[p.index], local)


def test_layout_core_imports_only_torch_numpy_stdlib():
    """The layout stage must stay framework-free (no megatron, transformers, vllm)."""
    import ast
    import pathlib
    import sys

    import nemo_dcr.layout as pkg

    allowed = {"torch", "numpy", "nemo_dcr"} | set(sys.stdlib_module_names)
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] in allowed, f"{path.name} imports {m}"


def test_docs_worked_examples():
    """The two shape examples of docs/layout.md."""
    from nemo_dcr.layout import ModelDims, ParallelLayout, build_plan

    d = ModelDims(num_layers=1, hidden_size=3, num_attention_heads=4, num_query_groups=2,
                  head_dim=1, ffn_hidden_size=6, vocab_size=8, make_vocab_size_divisible_by=1)
    plan = build_plan("llama", d, ParallelLayout(tp=2, tp_rank=1))
    res = plan.remap("decoder.layers.0.self_attention.linear_qkv.weight", torch.tensor([7]))
    want = [("model.layers.0.self_attn.k_proj.weight", [4])]
    assert [(p.name, p.index.tolist()) for p in res] == want
    d2 = ModelDims(num_layers=1, hidden_size=2, num_attention_heads=3, head_dim=1,
                   ffn_hidden_size=6, vocab_size=3, make_vocab_size_divisible_by=1)
    plan2 = build_plan("llama", d2, ParallelLayout(tp=3, tp_rank=2))
    assert plan2.params["decoder.layers.0.mlp.linear_fc1.weight"].local_shape == (4, 2)
    res = plan2.remap("decoder.layers.0.mlp.linear_fc1.weight", torch.tensor([5]))
    want = [("model.layers.0.mlp.up_proj.weight", [9])]
    assert [(p.name, p.index.tolist()) for p in res] == want
