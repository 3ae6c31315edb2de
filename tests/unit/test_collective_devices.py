"""Every collective hfdist calls is handed tensors on its group's device: a static check of the call sites.

NCCL takes CUDA tensors only, and a tensor made on the host (a factory without `device=`, or a `.cpu()` copy) and
handed to a collective of a GPU run's group fails there at its first call, while the CPU tests' gloo groups take it.
A run-time check cannot tell on a CPU machine, where the host is every tensor's device; so this test reads the
call sites instead. For each tensor collective of torch.distributed in hfdist/, the tensors it is handed by name
are followed to their last assignment before the call in the same function, and one made on the host is a finding,
unless the call names a group kept on the host on purpose (HOST_GROUPS, with why). Tensors that arrive as
arguments or attributes come from the model or the device and are not followed: the check catches the host-made
tensor, the one way a collective's input has been wrong in hfdist (the greedy generation's broadcast, the
pipeline evaluation's search for its last stage).
"""

from __future__ import annotations

import ast

from helpers import REPO

COLLECTIVES = {"broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
               "reduce", "gather", "scatter"}
# torch factories that make a tensor on the host unless given a device (the *_like ones take their input's)
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
             "linspace", "eye"}
# (file, group expression) -> why a host tensor is right there
HOST_GROUPS = {
    ("hfdist/train/preemption.py", "self.group"): "agreement_group(): gloo, so a step's agreement never syncs a GPU",
    ("hfdist/train/nonfinite.py", "self.group"): "agreement_group(), as preemption's",
}


def _host_made(value: ast.expr) -> bool:
    """Whether an expression makes its tensor on the host: a factory call without device=, or ends in .cpu()."""
    if isinstance(value, ast.IfExp):
        return _host_made(value.body) or _host_made(value.orelse)
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    if isinstance(func, ast.Attribute) and func.attr == "cpu":
        return True
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch" \
            and func.attr in FACTORIES:
        return not any(k.arg == "device" for k in value.keywords)
    return False


def _is_collective(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr in COLLECTIVES and isinstance(func.value, ast.Name) \
        and func.value.id == "dist"


def host_tensors_in_collectives(source: str, path: str) -> list[str]:
    """The findings in one module's source (module docstring): 'path:line: name (made on the host at line N)'."""
    findings = []
    tree = ast.parse(source)
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned: dict[str, list[tuple[int, ast.expr]]] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in ([target] if isinstance(target, ast.Name) else
                                 target.elts if isinstance(target, ast.Tuple) else []):
                        if isinstance(name, ast.Name):
                            value = node.value.elts[target.elts.index(name)] \
                                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) else node.value
                            assigned.setdefault(name.id, []).append((node.lineno, value))
        for call in ast.walk(function):
            if not isinstance(call, ast.Call) or not _is_collective(call):
                continue
            group = next((ast.unparse(k.value) for k in call.keywords if k.arg == "group"), None)
            if (path, group) in HOST_GROUPS:
                continue
            for arg in call.args:
                if not isinstance(arg, ast.Name):
                    continue
                before = [(line, value) for line, value in assigned.get(arg.id, []) if line < call.lineno]
                if before and _host_made(max(before, key=lambda lv: lv[0])[1]):
                    line = max(before, key=lambda lv: lv[0])[0]
                    findings.append(f"{path}:{call.lineno}: {arg.id} (made on the host at line {line})")
    return findings


def test_no_collective_is_handed_a_host_tensor():
    findings = []
    for module in sorted((REPO / "hfdist").rglob("*.py")):
        path = module.relative_to(REPO).as_posix()
        findings += host_tensors_in_collectives(module.read_text(), path)
    assert not findings, ("collectives handed a tensor made on the host (NCCL takes device tensors only; make it "
                          "with device= or .to(the group's device), or list a host group in HOST_GROUPS):\n"
                          + "\n".join(findings))


def test_the_check_finds_the_host_tensors_it_was_written_for():
    """The two call sites it was written for, as they were: the greedy choice copied to the host before its
    broadcast, and the pipeline evaluation's all_reduce of a tensor made without a device; and their fixes pass."""
    generation = (
        "def step(logits, ids, source_rank):\n"
        "    chosen = logits.argmax(-1).cpu() if logits is not None else torch.zeros(len(ids), dtype=torch.long)\n"
        "    dist.broadcast(chosen, src=source_rank)\n")
    evaluation = (
        "def source(self, rank):\n"
        "    holds = torch.tensor(rank if self.model.has_last_stage else self.args.world_size)\n"
        "    dist.all_reduce(holds, op=dist.ReduceOp.MIN)\n")
    assert host_tensors_in_collectives(generation, "g.py") == ["g.py:3: chosen (made on the host at line 2)"]
    assert host_tensors_in_collectives(evaluation, "e.py") == ["e.py:3: holds (made on the host at line 2)"]
    fixed_generation = generation.replace(".cpu()", "").replace(
        "    dist.broadcast", "    chosen = chosen.to(device)\n    dist.broadcast")
    fixed_evaluation = evaluation.replace("world_size)", "world_size, device=self.args.device)")
    assert host_tensors_in_collectives(fixed_generation, "g.py") == []
    assert host_tensors_in_collectives(fixed_evaluation, "e.py") == []
    # a host group named in HOST_GROUPS may take host tensors
    agreement = "def agree(self):\n    t = torch.tensor([1])\n    dist.all_reduce(t, group=self.group)\n"
    assert host_tensors_in_collectives(agreement, "hfdist/train/preemption.py") == []
    assert host_tensors_in_collectives(agreement, "other.py") == ["other.py:3: t (made on the host at line 2)"]
