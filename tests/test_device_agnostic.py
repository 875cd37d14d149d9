"""Static guard: the engine's tensor code creates tensors on the device they meet.

With ``ModelConfig.device = "cuda"`` logits, hidden states, KV caches and drafter weights live
on the GPU; a tensor factory call without ``device=`` makes a CPU tensor, and combining the two
fails (or silently copies). This walks the AST of the engine, speculative and model code and
fails on every factory call that passes no ``device=`` keyword unless its (file, function) is
on ``ALLOWED`` below, with the number of such calls there and why they are meant to be on the
CPU. A new device-less call anywhere (an allowed function included) fails until it either
names its device or is added here with a reason.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import TypeGuard

PACKAGE = Path(__file__).resolve().parents[1] / "tlt_serve"
FILES = sorted(
    path
    for folder in ("engine", "speculative", "models")
    for path in (PACKAGE / folder).glob("*.py")
)
FACTORIES = frozenset({
    "tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "eye", "linspace",
    "rand", "randn", "randint", "randperm",
})

# (file under tlt_serve/, function's qualified name) -> (device-less calls there, why)
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("engine/sampler.py", "Sampler._uniforms"): (
        2, "draws on the CPU generators (seeds sample alike on every device); moved in "
           "inverse_cdf"),
    ("engine/capture.py", "CaptureBuffer.finish"): (
        1, "a finished sample's token ids: the capture buffer is host memory"),
    ("engine/draft_tree.py", "DraftTree.ancestor_mask"): (
        1, "host-side: runner.extend_batch builds its mask on the host, then moves it"),
    ("engine/runner.py", "extend_batch"): (
        6, "host-side batch building from Python lists; every output is moved with "
           ".to(device)"),
    ("engine/runner.py", "_tree_bits"): (2, "host-side part of extend_batch (moved there)"),
    ("engine/runner.py", "_depths"): (2, "host-side part of extend_batch (moved there)"),
    ("speculative/verify.py", "drawer.draw"): (
        1, "the row's next uniform from its CPU generator; moved in inverse_cdf"),
    ("speculative/verify.py", "_uniforms"): (
        2, "acceptance coins from the CPU generators; _reject moves them to the device"),
    ("speculative/tree_draft.py", "_forward_frontier"): (
        5, "host-side ForwardBatch building (write columns, mask, bits, positions), moved "
           "with .to(device)"),
    ("speculative/drafter.py", "DrafterModel.__init__"): (
        1, "a registered buffer: it moves with the module's .to(device)"),
    ("models/batch.py", "flat_write_index"): (
        2, "host-side KV write index: callers pass host columns and move the result"),
    ("models/llama.py", "RMSNorm.__init__"): (
        1, "a parameter: built on the meta device by the loader, then to_empty(device)"),
    ("models/rope.py", "inv_frequencies"): (
        1, "the rotary table is computed on the CPU in fp64, then moved by the loader"),
    ("models/rope.py", "cos_sin_table"): (1, "as inv_frequencies (moved by the loader)"),
}


def device_less_calls(source: str) -> list[tuple[str, int]]:
    """(qualified name of the enclosing function, line) of each ``torch.<factory>(...)`` call
    that passes no ``device=`` keyword; module-level calls are under ``<module>``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                visit(child, (*scope, child.name))
                continue
            if _is_factory(child) and not any(k.arg == "device" for k in child.keywords):
                found.append((".".join(scope) or "<module>", child.lineno))
            visit(child, scope)

    visit(ast.parse(source), ())
    return found


def _is_factory(node: ast.AST) -> TypeGuard[ast.Call]:
    func = node.func if isinstance(node, ast.Call) else None
    return (
        isinstance(func, ast.Attribute)
        and func.attr in FACTORIES
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
    )


def test_tensor_factories_name_their_device_or_are_allowed() -> None:
    counts: Counter[tuple[str, str]] = Counter()
    lines: dict[tuple[str, str], list[int]] = {}
    for path in FILES:
        name = path.relative_to(PACKAGE).as_posix()
        for func, line in device_less_calls(path.read_text()):
            counts[name, func] += 1
            lines.setdefault((name, func), []).append(line)
    problems = []
    for key, n in sorted(counts.items()):
        allowed = ALLOWED.get(key, (0, ""))[0]
        if n != allowed:
            where = ", ".join(f"{key[0]}:{line}" for line in lines[key])
            problems.append(f"{key}: {n} device-less factory calls, {allowed} allowed ({where})")
    problems += [f"{key}: allowed but no device-less call left (drop the entry)"
                 for key in sorted(ALLOWED.keys() - counts.keys())]
    assert not problems, (
        "tensor factory calls without device= (pass device=<the tensor it meets>.device, or "
        "add the (file, function) to ALLOWED with a reason):\n" + "\n".join(problems)
    )


def test_the_guard_sees_device_less_calls() -> None:
    source = '''
import torch
X = torch.zeros(3)
class A:
    def f(self, logits):
        ok = torch.arange(4, device=logits.device)
        def g():
            return torch.tensor([1, 2])
        return torch.full((2,), 1.0), logits.new_zeros(2), torch.where(ok > 1, ok, 0)
'''
    assert device_less_calls(source) == [("<module>", 3), ("A.f.g", 8), ("A.f", 9)]


def test_the_guard_scans_the_engine() -> None:
    names = {path.relative_to(PACKAGE).as_posix() for path in FILES}
    assert {"engine/sampler.py", "engine/runner.py", "speculative/verify.py",
            "speculative/decoder.py", "models/llama.py"} <= names
    assert all(file in names for file, _ in ALLOWED)
