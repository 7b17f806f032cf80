"""Trainer configs refused at config time (issue 25.3): gaussian normalisation with diffusion sample
clipping, and the UMI config without the camera-to-TCP transform (unless it is explicitly identity)."""

from __future__ import annotations

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from dpflow_core.errors import RunError
from dpflow_core.train.app import CONFIG_DIR
from dpflow_core.train.config import check_config, spec_from_config

UMI = "train_diffusion_unet_timm_umi"


def _cfg(name: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        return compose(name, overrides=["task.dataset_path=x.npz", *overrides])


def test_the_umi_config_needs_tx_cam_tcp_or_an_explicit_identity():
    with pytest.raises(RunError, match=r"task\.tx_cam_tcp is required.*task\.tx_cam_tcp=identity"):
        check_config(_cfg(UMI))
    identity = _cfg(UMI, "task.tx_cam_tcp=identity")
    check_config(identity)
    assert np.array_equal(spec_from_config(identity, 30.0).tx, np.eye(4))
    given = _cfg(UMI, "task.tx_cam_tcp={translation: [0.0, 0.0, 0.15]}")
    check_config(given)
    assert spec_from_config(given, 30.0).tx[:3, 3].tolist() == [0.0, 0.0, 0.15]
    with pytest.raises(ValueError, match="must be identity"):
        spec_from_config(_cfg(UMI, "task.tx_cam_tcp=eye"), 30.0)
    # the other shipped configs train on the camera pose by default, as before
    for name in ("train_diffusion_unet_image", "tiny", "demo"):
        cfg = _cfg(name)
        check_config(cfg)
        assert np.array_equal(spec_from_config(cfg, 10.0).tx, np.eye(4))


@pytest.mark.parametrize("name", ["tiny", "train_diffusion_unet_image", UMI])
def test_gaussian_normalisation_with_sample_clipping_is_refused(name):
    extra = ("task.tx_cam_tcp=identity",) if name == UMI else ()
    with pytest.raises(RunError, match=r"task\.lowdim_norm=gaussian with policy\.noise_scheduler\.clip_sample=true"):
        check_config(_cfg(name, "task.lowdim_norm=gaussian", *extra))
    check_config(_cfg(name, "task.lowdim_norm=gaussian", "policy.noise_scheduler.clip_sample=false", *extra))
    check_config(_cfg(name, "task.lowdim_norm=range", *extra))


def test_spacing_in_seconds_means_the_same_time_at_any_rate():
    """DESIGN rule 15: ``task.obs_dt_s`` / ``action_dt_s`` become steps from the measured frequency."""
    sim = _cfg("sim")
    for hz, steps in ((30.0, 3), (29.97, 3), (60.0, 6), (15.0, 2)):
        spec = spec_from_config(sim, hz)
        assert (spec.obs_down_sample_steps, spec.action_down_sample_steps) == (steps, steps)
    umi = _cfg(UMI, "task.tx_cam_tcp=identity")
    assert spec_from_config(umi, 59.94).action_down_sample_steps == 3  # UMI's own 0.05 s at its GoPro rate
    assert spec_from_config(umi, 30.0).action_down_sample_steps == 2  # was 3 steps = 0.1 s on 30 Hz data
    steps = _cfg("tiny", "task.obs_down_sample_steps=4")  # no seconds given: the step keys, as before
    assert spec_from_config(steps, 30.0).obs_down_sample_steps == 4
    with pytest.raises(ValueError, match="obs_dt_s must be > 0"):
        spec_from_config(_cfg("sim", "task.obs_dt_s=0"), 30.0)
