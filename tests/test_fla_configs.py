"""ops/_fla.py's carried fla configurations: fla pointed at the folder of the GPU it runs on, strict keys, the
user's own settings left alone; and the carried files readable as fla reads them. (fla is not installed on a CPU
machine: a stand-in of ``fla.ops.utils.cache`` with its names.)"""

import enum
import json
import sys
import types

import pytest

from hf_openjev.ops import _fla


class FlaCacheMode(enum.Enum):
    DISABLED = "disabled"
    STRICT = "strict"


@pytest.fixture
def fla_cache(monkeypatch, tmp_path):
    cache = types.ModuleType("fla.ops.utils.cache")
    cache.FlaCacheMode = FlaCacheMode
    cache.FLA_CACHE_MODE = FlaCacheMode.DISABLED
    cache.get_gpu_info = lambda: "NVIDIA_H200"
    utils = types.ModuleType("fla.ops.utils")
    utils.cache = cache
    ops = types.ModuleType("fla.ops")
    ops.utils = utils
    fla = types.ModuleType("fla")
    fla.ops = ops
    for name, module in {"fla": fla, "fla.ops": ops, "fla.ops.utils": utils, "fla.ops.utils.cache": cache}.items():
        monkeypatch.setitem(sys.modules, name, module)
    for name in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_fla, "CARRIED_CONFIGS", tmp_path)
    return cache


def test_fla_takes_the_folder_of_its_gpu_in_strict_mode(fla_cache, tmp_path, monkeypatch):
    (tmp_path / "NVIDIA_H200").mkdir()
    assert _fla.use_carried_configs() == tmp_path / "NVIDIA_H200"
    assert fla_cache.FLA_CACHE_MODE is FlaCacheMode.STRICT
    import os

    assert os.environ["FLA_CONFIG_DIR"] == str(tmp_path / "NVIDIA_H200")


def test_another_gpu_or_the_users_own_settings_change_nothing(fla_cache, tmp_path, monkeypatch):
    (tmp_path / "NVIDIA_H100_80GB_HBM3").mkdir()
    assert _fla.use_carried_configs() is None and fla_cache.FLA_CACHE_MODE is FlaCacheMode.DISABLED
    (tmp_path / "NVIDIA_H200").mkdir()
    monkeypatch.setenv("FLA_CONFIG_DIR", "elsewhere")
    assert _fla.use_carried_configs() is None and fla_cache.FLA_CACHE_MODE is FlaCacheMode.DISABLED
    monkeypatch.delenv("FLA_CONFIG_DIR")
    monkeypatch.setenv("FLA_CACHE_MODE", "disabled")
    assert _fla.use_carried_configs() is None and fla_cache.FLA_CACHE_MODE is FlaCacheMode.DISABLED


def test_every_carried_file_is_in_flas_format():
    """Each <gpu>/<kernel>.json: fla's KernelConfigFile fields, every entry a key and a config fla can build."""
    files = sorted(_fla.CARRIED_CONFIGS.glob("*/*.json"))
    assert files, "ops/fla_configs/ carries no configuration"
    for path in files:
        data = json.loads(path.read_text())
        assert data["kernel_name"] == path.stem and data["autotune_entries"], path
        for entry in data["autotune_entries"].values():
            assert isinstance(entry["autotune_key"], list), path
            assert {"kwargs", "num_warps", "num_stages", "num_ctas"} <= set(entry["config"]), path
