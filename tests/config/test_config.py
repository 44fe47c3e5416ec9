import pytest

from diag.config import ExperimentConfig, InfoConfig, ToyConfig, diag_home, quick_mode


def test_validation_names_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"ToyConfig.steps=0: must be a number > 0"):
        ToyConfig(steps=0)
    with pytest.raises(ValueError, match=r"ToyConfig.batch_size=-4: must be a number > 0"):
        ToyConfig(batch_size=-4)
    with pytest.raises(ValueError, match=r"ToyConfig.prep_ms=-1.0: must be a number >= 0"):
        ToyConfig(prep_ms=-1.0)
    with pytest.raises(ValueError,
                       match=r"ToyConfig.device='tpu': allowed values are 'auto', 'cpu', 'cuda'"):
        ToyConfig(device="tpu")
    with pytest.raises(ValueError, match=r"InfoConfig.probe_size=True"):
        InfoConfig(probe_size=True)  # a bool is not a size


def test_quick_is_smaller_and_overridable():
    full, quick = ToyConfig(), ToyConfig.quick()
    assert quick.steps < full.steps and quick.width < full.width
    assert ToyConfig.quick(steps=3).steps == 3
    with pytest.raises(ValueError):
        ToyConfig.quick(steps=-1)


def test_default_follows_diag_quick(monkeypatch):
    monkeypatch.setenv("DIAG_QUICK", "1")
    assert quick_mode() and ToyConfig.default() == ToyConfig.quick()
    monkeypatch.setenv("DIAG_QUICK", "0")
    assert not quick_mode() and ToyConfig.default() == ToyConfig()
    # an explicit quick= wins over the environment either way; overrides win over both
    assert ToyConfig.default(quick=True) == ToyConfig.quick()
    monkeypatch.setenv("DIAG_QUICK", "1")
    assert ToyConfig.default(quick=False) == ToyConfig()
    assert ToyConfig.default(quick=True, steps=3).steps == 3


def test_device_accepts_cuda_n_and_names_what_is_allowed():
    assert ToyConfig(device="cuda:1").device == "cuda:1"
    for bad in ("tpu", "cuda:x", "cpu:0", "cuda:"):
        with pytest.raises(ValueError,
                           match=r"ToyConfig.device=.*'auto', 'cpu', 'cuda' and 'cuda:N'"):
            ToyConfig(device=bad)


def test_to_dict_round_trips():
    cfg = ToyConfig.quick(prep_ms=2.0)
    assert ToyConfig(**cfg.to_dict()) == cfg


def test_diag_home_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("DIAG_HOME", str(tmp_path))
    assert diag_home() == tmp_path


def test_every_default_field_has_a_comment():
    # STYLE: literal defaults with a one-line comment each
    import inspect
    import re

    for cls in ExperimentConfig.__subclasses__():
        body = inspect.getsource(cls)
        for line in body.splitlines():
            if re.match(r"^    [a-z_]+: .+ = ", line):
                assert "#" in line, f"{cls.__name__}: default without a comment: {line.strip()}"


def test_no_field_shadows_the_config_api():
    import dataclasses

    for cls in ExperimentConfig.__subclasses__():
        names = {f.name for f in dataclasses.fields(cls)}
        assert not names & {"quick", "default", "validate", "replace", "to_dict"}, cls.__name__
        assert callable(cls.quick) and callable(cls.default)
