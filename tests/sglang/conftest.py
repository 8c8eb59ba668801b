"""The SGLang backend's tests run in a venv of their own with SGLang installed (``.ci/run``).

SGLang's own modules warn at import (deprecated torch APIs, pydantic, ...): they are imported
here once with warnings silenced, so that the suite's warnings-as-errors applies to what the
tests and kvproto do, not to SGLang's import. Without SGLang every test here is skipped."""

import importlib.util
import warnings

import sglang_cpu_env as cpu_env

cpu_env.prepare()


def _installed() -> bool:
    """SGLang itself (with this folder on sys.path, a bare ``sglang`` may name the folder)."""
    try:
        return importlib.util.find_spec("sglang.srt") is not None
    except ImportError:
        return False


if _installed():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.disaggregation.decode  # noqa: F401
        import sglang.srt.disaggregation.prefill  # noqa: F401
        import sglang.srt.distributed.parallel_state  # noqa: F401
        import sglang.srt.managers.disagg_service  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
        import sglang.srt.plugins  # noqa: F401
        import sglang.srt.server_args  # noqa: F401
