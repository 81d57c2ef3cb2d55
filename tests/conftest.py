import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The engines the tests start record themselves (nanostream/discovery.py) in a runtime directory of
# the test run's own, never in the user's: a client given no address finds only what a test started.
os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="ns-run-")

# Under pytest-xdist (-n N) each worker takes its share of the cores for torch's threads (and the processes it
# starts, through OMP_NUM_THREADS), so N workers do not oversubscribe the machine.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))) > 1:
    share = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(share)
    torch.set_num_threads(share)

# Without a GPU the Triton kernels run under Triton's interpreter; it must be chosen before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_triton_interpreter() -> None:
    """Let the interpreter use a loaded scalar as a loop bound under NumPy >= 2.4.

    Triton 3.6's interpreter holds a loaded scalar as a 1-element array and converts it with ``int()``,
    which NumPy 2.4 no longer allows for arrays with a dimension; compiled kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton version: nothing to patch
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter()

from nanostream.testing import make_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), architecture="Qwen3ForCausalLM", seed=1)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen2"), architecture="Qwen2ForCausalLM", seed=2)


@pytest.fixture(scope="session", params=["Qwen3ForCausalLM", "Qwen2ForCausalLM"])
def model_dir(request, qwen3_dir, qwen2_dir):
    return qwen3_dir if request.param == "Qwen3ForCausalLM" else qwen2_dir


APPS = Path(__file__).resolve().parents[1] / "apps"


@pytest.fixture(scope="module")
def load_app():
    """``load_app("soak")``: apps/soak.py as a module, importing its sibling modules as the program does
    (apps/ first on ``sys.path``); after the test module, the path and every module loaded from apps/ go."""
    before = set(sys.modules)
    sys.path.insert(0, str(APPS))

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, APPS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module

    yield load
    sys.path.remove(str(APPS))
    for name in set(sys.modules) - before:
        if str(APPS) in (getattr(sys.modules[name], "__file__", None) or ""):
            del sys.modules[name]


@pytest.fixture(scope="session")
def hf_model_cache():
    """transformers models by directory, loaded once per session (float32, eval)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


# The OpenAI frontend's test modules: each defines ``url``, its server, started with helpers.API_KEY.


@pytest.fixture(scope="module")
def model(qwen3_dir) -> str:
    return os.path.basename(qwen3_dir)  # the default served name


@pytest.fixture(scope="module")
def engine(qwen3_dir):
    """An engine process on the tiny Qwen3 model (CPU) for a test module's servers (a module may define its own)."""
    from helpers import engine_processes

    with engine_processes(str(qwen3_dir), {"main": dict(kvcache_block_size=16, device="cpu")}) as started:
        yield started["main"].address


@pytest.fixture(scope="module")
def api(url):
    import openai
    from helpers import API_KEY

    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    import httpx
    from helpers import API_KEY

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        yield client
