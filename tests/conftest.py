"""Session fixtures: tiny random Clef releases, their GGUF conversions, loaded models
and the reference oracle. Everything is built once per session, on demand.

`pytest -m device --on-device` (tools/device_check.sh) is the device set: the tests marked `device` but those in
NOT_ON_DEVICE, with every model, head and vision tower on the build's device backend (Vulkan, CUDA) wherever a
test leaves n_gpu_layers at its default. --on-device sets that default once (settings.N_GPU_LAYERS_ENV, which every
load, `clef-gguf` subprocesses included, reads). A CPU build of llama-cpp-python ignores the offload: there the same
run rehearses the device set's configuration on the CPU (tests/test_device_set.py runs a few of its tests so in CI).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import clef_gguf  # noqa: E402

# Before any test module imports ray (test_ray_installed.py's importorskip is collected first): Ray reads the
# variables this sets (a loopback cluster, token auth) when it is imported, and a driver that imported it without them
# cannot join the cluster of clef_gguf.testing.ray_cluster ("Failed to connect to Ray cluster at 192.0.2.2:...").
import clef_gguf.testing.ray_cluster  # noqa: E402, F401
from clef_gguf.conversion.convert import default_mmproj_path  # noqa: E402
from clef_gguf.errors import ReleaseError  # noqa: E402
from clef_gguf.settings import N_GPU_LAYERS_ENV, offload_default  # noqa: E402
from clef_gguf.testing.oracle import Oracle  # noqa: E402
from clef_gguf.testing.release_builder import RELEASES, build_release  # noqa: E402

MAX_PROMPT_TOKENS = 8192  # the long-state request has several thousand tokens
MODELS_KEPT = 2  # Workspace.model's loaded models (test_api_safety compares two at once)
NO_DEVICE = (
    "--on-device: this llama-cpp-python has no device backend (a CPU build), which ignores the offload: the device set "
    "runs on the CPU, a rehearsal of its configuration (tools/vulkan_env.sh builds llama-cpp-python with Vulkan)"
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--on-device", action="store_true", help="Run models on the device backend (see tests/conftest.py).")


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("on_device"):
        return
    # The one value the device set changes: every load that omits n_gpu_layers offloads every layer, and with them its
    # head and vision tower (runtime/decider.py), in this process, its xdist workers and its `clef-gguf` subprocesses.
    os.environ[N_GPU_LAYERS_ENV] = "-1"
    if device_build():
        import live_server

        live_server.HEALTH_TIMEOUT_S = 1200.0  # a served process compiles the device's pipelines before /health


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("on_device"):
        return None if device_build() else NO_DEVICE
    return None


# The quick device set (`-m device_quick`, tools/device_check.sh --quick): one case of each path the device set
# covers, so that a device run fits in minutes on a software device. Each is a node id, or the start of one.
DEVICE_QUICK = (
    "tests/test_parity.py::test_probabilities_match_the_reference[untied_f32-f32-auto-0.005-mixed]",
    "tests/test_parity.py::test_probabilities_match_the_reference[untied_f32-q8_0-auto-0.035-long_state]",
    "tests/test_native_head.py::test_native_head_equals_the_numpy_reference[untied_f32-f32-auto-0.0001]",
    "tests/test_native_head.py::test_native_head_equals_the_numpy_reference[k256-q4_k_m-auto-0.0001]",
    "tests/test_native_head.py::test_decide_uses_the_native_head",
    "tests/test_state_cache.py::test_a_hit_gives_the_answers_of_the_cache_off_and_of_the_reference[untied_f32-f32-128]",
    "tests/test_batching.py::test_batched_hidden_states_and_answers_are_those_alone[f32]",
    "tests/test_plan.py::test_the_plan_is_what_llama_cpp_allocates",
    "tests/test_offload.py::test_half_the_layers_on_the_device_answer_as_the_cpu",
    "tests/test_images.py::test_answers_match_the_reference[f32-1_png_up]",
    "tests/test_mtmd.py::test_the_tower_in_llama_cpp_is_the_release_tower[f32]",
    "tests/test_clients.py::test_typesafe_sdk_parses_every_answer_type_and_gets_422_for_a_null_level",
    "tests/test_clients.py::test_clef_evals_judges_a_choice_and_evaluates_a_set",
)

# Tests of the device set's modules that --on-device leaves out: the device adds nothing to what they check, and on
# lavapipe they cost 108 s of the whole set's 662 (measured 2026-12-02). The tokenizer's tokens and spans and the
# usage counts are the host's; the fixtures' answers are the oracle's; the 30,000-token request checks the host
# memory a long prompt takes, and its prefill across ubatches on the device is test_state_cache's at ubatch 128
# against the oracle, and clef-rag's 20,600-token state through `serve`.
NOT_ON_DEVICE = (
    "tests/test_parity.py::test_tokens_and_spans_match_the_reference",
    "tests/test_parity.py::test_fixture_probabilities_are_far_from_uniform",
    "tests/test_clients.py::test_a_30000_token_request_prefilled_in_ubatches_equals_the_oracle",
)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(DEVICE_QUICK):
            item.add_marker(pytest.mark.device_quick)
        if item.get_closest_marker("ray"):  # a Ray cluster takes seconds to start, its tests more: out of the inner loop
            item.add_marker(pytest.mark.slow)
        if "ray_address" in getattr(item, "fixturenames", ()) and worker_group(item.nodeid) != "ray":
            raise pytest.UsageError(f"{item.nodeid} joins the session's Ray cluster: add its module to SAME_WORKER")
    if gone := [name for name in SAME_WORKER if not (Path(__file__).parent / name).is_file()]:
        raise pytest.UsageError(f"SAME_WORKER names test modules that are not there: {gone}")
    if not config.getoption("on_device"):
        return
    left_out = [item for item in items if item.nodeid.startswith(NOT_ON_DEVICE)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.nodeid.startswith(NOT_ON_DEVICE)]


# pytest-xdist's workers (tools/test.sh: -n) take a group of tests at a time: a module, so that its module fixtures (a
# served process, a loaded model) are made once; the modules that join the session's Ray cluster together, so that
# there is one; the modules that train the same clef-finetune configurations (clef_gguf/testing/finetune.py trains each
# once per process) together. (xdist's own --dist loadgroup reads xdist_group marks by rewriting item._nodeid, which
# pytest 9 no longer reads: hence a scheduler of our own.)
SAME_WORKER = {
    **dict.fromkeys(("test_adapter_refusals.py", "test_ray_dataset.py", "test_ray_serve.py", "test_ray_sources.py"), "ray"),
    **dict.fromkeys(("test_adapter_file.py", "test_adapters.py", "test_finetune.py", "test_readme.py"), "trainings"),
}


def worker_group(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return SAME_WORKER.get(module.rsplit("/", 1)[-1], module)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: a run without it has none)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByGroup(config, log)


# The fast lane's rule (CONTRIBUTING.md): a test whose run takes 1.5 s or more on the 2-core CI machine is marked slow.
# A run lists the unmarked tests whose call alone took twice that, so that the fast lane does not drift; a list, not a
# failure: a timing on a shared machine is no verdict.
FAST_BUDGET_S = 1.5
_over_budget: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # (in the process that reports: pytest-xdist's workers send their reports to it)
    if report.when == "call" and report.duration >= 2 * FAST_BUDGET_S and "slow" not in report.keywords:
        _over_budget[report.nodeid] = report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _over_budget:
        terminalreporter.section(f"tests not marked slow that took over {2 * FAST_BUDGET_S:g} s (CONTRIBUTING.md)")
        for nodeid, seconds in sorted(_over_budget.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:6.2f} s  {nodeid}")


@pytest.fixture(scope="session")
def default_gpu_layers() -> int:
    """The n_gpu_layers a load that omits it gets (settings.offload_default): -1 in the device set, else 0."""
    return offload_default()


def offloaded() -> bool:
    """Whether a load that omits n_gpu_layers asks for offload: what a test that builds a head, a backbone or a vision
    tower itself hands them (gpu, use_gpu), as the runtime does (runtime/decider.py)."""
    return offload_default() != 0


def f16_tiles(device: str) -> bool:
    """Whether the products on this device round their operands to F16, whatever the graph asks.

    ggml-vulkan's matrix-matrix shaders hold both operands as float16 in shared memory on a device with fp16
    (its FLOAT_TYPE), F32 weights too; ggml_mul_mat_set_prec(GGML_PREC_F32) only picks the accumulator.
    Measured on lavapipe: the head's logits 2.3e-3 off, the same with the precision set or not, until the
    head split its products in F16-exact parts (head_graph.cpp); llama.cpp's own products (the backbone's)
    still round. GGML_VK_DISABLE_F16=1 gives F32 tiles.
    """
    return device.startswith("Vulkan") and not os.environ.get("GGML_VK_DISABLE_F16")


def device_build() -> bool:
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


class Workspace:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.release = cache(self._release)
        self._gguf_cached = cache(self._gguf)
        self.oracle = cache(self._oracle)
        self._models: OrderedDict[tuple[str, str, str], clef_gguf.ClefModel] = OrderedDict()  # least recently used first

    def _release(self, name: str) -> Path:
        return build_release(self.root / name, RELEASES[name])

    # Cached by all their arguments, the defaults spelled out: gguf(n, t) and gguf(n, t, "auto") are one file.
    def gguf(self, name: str, file_type: str, head_type: str = "auto") -> Path:
        return self._gguf_cached(name, file_type, head_type)

    def mmproj(self, name: str, file_type: str) -> Path:
        """The vision tower convert writes beside gguf(name, file_type) (its mmproj type follows the file type)."""
        return default_mmproj_path(self.gguf(name, file_type))

    def model(self, name: str, file_type: str, head_type: str = "auto") -> clef_gguf.ClefModel:
        """The session's loaded model of a fixture file. At most MODELS_KEPT stay loaded, the least recently used
        closed first: each reserves 8.7 GB of address space (its one 8192-token ubatch), and with more alive the
        test process's forks (subprocess, pty) fail with ENOMEM under the kernel's overcommit heuristic."""
        key = (name, file_type, head_type)
        model = self._models.get(key)
        if model is None:
            while len(self._models) >= MODELS_KEPT:
                self._models.popitem(last=False)[1].close()
            model = self._models[key] = self._model(name, file_type, head_type)
        self._models.move_to_end(key)
        return model

    def _gguf(self, name: str, file_type: str, head_type: str) -> Path:
        out = self.root / f"{name}-{file_type}-{head_type}.gguf"
        return clef_gguf.convert(self.release(name), out, file_type, head_type=head_type)

    def _oracle(self, name: str) -> Oracle:
        return Oracle(self.release(name))

    def _model(self, name: str, file_type: str, head_type: str) -> clef_gguf.ClefModel:
        # One physical batch (ubatch = n_ctx): the reference the ubatch tests compare the default prefill with.
        return clef_gguf.load(
            self.gguf(name, file_type, head_type), max_prompt_tokens=MAX_PROMPT_TOKENS, ubatch=MAX_PROMPT_TOKENS
        )

    def close(self) -> None:
        for model in self._models.values():
            model.close()


@pytest.fixture(scope="session")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workspace]:
    workspace = Workspace(tmp_path_factory.mktemp("clef"))
    yield workspace
    workspace.close()


@pytest.fixture
def refused_release(ws: Workspace, tmp_path: Path) -> Callable[[Callable[[Path], object]], str]:
    """convert's refusal of a copy of the untied f32 release damaged by `damage(folder)`: its message, checked to be
    one line and to leave nothing in tmp_path but the copy."""

    def refuse(damage: Callable[[Path], object]) -> str:
        release = Path(shutil.copytree(ws.release("untied_f32"), tmp_path / "release"))
        damage(release)
        with pytest.raises(ReleaseError) as raised:
            clef_gguf.convert(release, tmp_path / "out.gguf", "f32")
        assert "\n" not in str(raised.value)
        assert [p.name for p in tmp_path.iterdir()] == ["release"]
        return str(raised.value)

    return refuse


@pytest.fixture(scope="session")
def oracle_probabilities(ws: Workspace) -> Callable[[str, str], dict[str, dict[str, float]]]:
    """Oracle probabilities per (release, request name), computed once."""
    from clef_gguf.testing.request_suite import all_requests

    requests = all_requests()

    @cache
    def compute(release: str, request_name: str) -> dict[str, dict[str, float]]:
        return ws.oracle(release).probabilities(requests[request_name])

    return compute


# --- Ray --------------------------------------------------------------------------------------------------------------
# One local Ray cluster on loopback for the whole session, this process its driver: test_ray_serve, test_ray_dataset
# and test_adapter_refusals' Ray cases join it (their library calls in process, their `clef-gguf`
# subprocesses through RAY_ADDRESS). Started by the first test that asks for it, stopped at the session's end: a
# cluster's start and stop, and Serve's, cost seconds each. Only test_ray_installed.py's `serve --ray` starts its own.
RAY_EXTRA = "Ray is the optional extra: pip install 'clef-gguf[ray]' (tools/test.sh does)"


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """The session's Ray cluster (4 CPUs for Ray to reserve: two replicas or actors of one thread, and room for a
    replacement before Ray has counted a killed one out): its address."""
    pytest.importorskip("ray.data", reason=RAY_EXTRA)
    pytest.importorskip("ray.serve", reason=RAY_EXTRA)
    from clef_gguf.testing.ray_cluster import local_cluster

    with local_cluster(num_cpus=4) as address:
        yield address


@pytest.fixture(scope="session")
def ray_serve_port(ray_address: str) -> int:
    """Serve on the session's cluster, started once: the port of its HTTP proxy, where every `serve --ray` that joins
    the cluster serves (give it `--port`: live_server.served's `port`), one application after another."""
    from clef_gguf.testing.ray_cluster import started_serve

    return started_serve()
