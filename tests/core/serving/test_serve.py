"""`dpflow serve` over openpi's websocket protocol, and the timing contract.

The server runs for real (`dpflow serve` on the session's tiny checkpoint, 127.0.0.1, a free
port) and the unmodified `openpi-client` from PyPI talks to it from its own environment
(``.venv-openpi-client``, made by scripts/setup-openpi-client.sh: it needs numpy<2). Its answers
must equal the in-process ``Policy.predict_action`` with the same noise seed. The alignment is
checked against the training sampler itself (``read_raw`` over a replay buffer) and analytic motion.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.spatial.transform import Rotation

from conftest import REPO, VENV_BIN, require_service
from dpflow_core.serving import (
    ObservationError,
    ServeSettings,
    StaleObservationError,
    actions_to_execute,
    align_observation,
    serve_command,
)
from dpflow_core.train.data import (
    GRIPPER_KEY,
    POS_KEY,
    ROT_KEY,
    ObsActionSpec,
    lowdim_arrays,
    obs_positions,
    read_raw,
)

OPENPI_PYTHON = REPO / ".venv-openpi-client" / "bin" / "python"
SEEDS = (0, 1, 7)

# Runs in .venv-openpi-client: only openpi_client, its websockets and numpy<2.
OPENPI_SESSION = r"""
import json, sys, threading, time
import numpy as np
import websockets.sync.client
from openpi_client import msgpack_numpy, websocket_client_policy

port, inputs, out = int(sys.argv[1]), np.load(sys.argv[2]), sys.argv[3]
seeds = [int(s) for s in inputs["seeds"]]
keys = ["robot0_eef_pos", "robot0_eef_rot_axis_angle", "robot0_gripper_width"]

def obs(i):
    return {k: inputs[f"obs{i}_{k}"] for k in keys + ["timestamp"]}

def streams(i, now):
    d = {k: {"timestamp": inputs[f"obs{i}_timestamp"], "value": inputs[f"obs{i}_{k}"]} for k in keys}
    d["now_s"] = now
    return d

def error(client, request):
    try:
        client.infer(request)
    except RuntimeError as exc:
        return str(exc)
    return None

result, arrays = {}, {}
client = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=port)
result["metadata"] = client.get_server_metadata()
for i, seed in enumerate(seeds):
    answer = client.infer(obs(i) | {"noise_seed": seed})
    arrays[f"aligned{i}_action"], arrays[f"aligned{i}_timestamp"] = answer["action"], answer["timestamp"]
    result[f"timing{i}"] = answer["server_timing"]
now = float(inputs["obs0_timestamp"][-1]) + 0.05
answer = client.infer(streams(0, now) | {"noise_seed": seeds[0]})
arrays["streams0_action"], arrays["streams0_timestamp"] = answer["action"], answer["timestamp"]

result["errors"] = {
    "missing key": error(client, {"robot0_eef_pos": inputs["obs0_robot0_eef_pos"]}),
    "wrong shape": error(client, obs(0) | {"robot0_eef_pos": np.zeros((2, 4))}),
    "wrong step count": error(client, obs(0) | {"robot0_gripper_width": np.zeros((5, 1))}),
    "not a map": error(client, [1, 2, 3]),
    "stale": error(client, streams(0, now + 30.0)),
    "unordered": error(client, streams(0, now) | {"robot0_gripper_width": {"timestamp": inputs["obs0_timestamp"][::-1], "value": inputs["obs0_robot0_gripper_width"]}}),
    "mixed kinds": error(client, obs(0) | {"robot0_eef_pos": streams(0, now)["robot0_eef_pos"]}),
    "misspelt now_s": error(client, {k: v for k, v in streams(0, now).items() if k != "now_s"} | {"now": now}),
}
# arrays written as docs/serving.md spells them, with text keys (not msgpack_numpy's byte keys)
import msgpack
text_keys = {k: {"__ndarray__": True, "data": np.ascontiguousarray(v).tobytes(), "dtype": v.dtype.str, "shape": list(v.shape)}
             for k, v in obs(0).items()}
raw_text = websockets.sync.client.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None)
raw_text.recv()
raw_text.send(msgpack.packb(text_keys | {"noise_seed": seeds[0]}, use_bin_type=True))
arrays["text_keys_action"] = msgpack_numpy.unpackb(raw_text.recv())["action"]
raw_text.close()
raw = websockets.sync.client.connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None)
raw.recv()
raw.send(b"\xc1 not msgpack")
result["errors"]["garbage"] = raw.recv()
raw.send("a text frame")
result["errors"]["text frame"] = raw.recv()
raw.send(msgpack_numpy.packb(obs(0) | {"noise_seed": seeds[0]}))  # the same socket still serves
arrays["after_garbage_action"] = msgpack_numpy.unpackb(raw.recv())["action"]
raw.send(msgpack_numpy.packb(obs(1)))  # then leaves before its answer
raw.close()
arrays["after_errors_action"] = client.infer(obs(0) | {"noise_seed": seeds[0]})["action"]

barrier, times = threading.Barrier(2), {}
def run(name, seed_offset):
    c = websocket_client_policy.WebsocketClientPolicy(host="127.0.0.1", port=port)
    barrier.wait()
    stamps = []
    for j in range(6):
        a = c.infer(obs(j % len(seeds)) | {"noise_seed": 100 * seed_offset + j})
        arrays[f"{name}{j}_action"] = a["action"]
        stamps.append(time.monotonic())
        result.setdefault("batch_sizes", []).append(a["server_timing"]["batch_size"])
    times[name] = stamps
threads = [threading.Thread(target=run, args=(n, k)) for k, n in enumerate(("A", "B"), start=1)]
[t.start() for t in threads]
[t.join() for t in threads]
result["times"] = times
np.savez(out + ".npz", **arrays)
with open(out + ".json", "w") as f:
    json.dump(result, f)
"""


def openpi_python() -> Path:
    require_service("openpi-client", None if OPENPI_PYTHON.is_file() else f"{OPENPI_PYTHON} not found")
    return OPENPI_PYTHON


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """``dpflow serve`` on the tiny checkpoint: yields ``(process, port)``; stopped by its PID."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as err:
        # a window long enough that the two concurrent clients' requests meet in one batch on a loaded machine
        settings = ServeSettings(port=0, batch_window_s=0.05)
        command = shlex.split(serve_command(tiny_checkpoint.checkpoint, settings))  # as Dagster shows it
        assert command[:2] == ["dpflow", "serve"]
        proc = subprocess.Popen([str(VENV_BIN / "dpflow"), *command[1:]],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving "), f"dpflow serve did not start: {line!r}\n{log.read_text()}"
        yield proc, int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    from dpflow_core.inference import load_policy

    return load_policy(tiny_checkpoint.checkpoint)


def observations(dataset: Path, policy) -> list[dict[str, np.ndarray]]:
    """Aligned observations of three anchors of the recorded data (To steps, oldest first)."""
    z = np.load(dataset)
    dt = 1.0 / policy.frequency_hz
    out = []
    for anchor in (5, 17, 61):
        steps = anchor - np.arange(policy.n_obs_steps)[::-1]
        obs = {k: z[f"data__{k}"][steps].astype(np.float64) for k in (POS_KEY, ROT_KEY, GRIPPER_KEY)}
        obs["timestamp"] = 1000.0 + steps * dt
        out.append(obs)
    return out


def in_process(policy, obs, seed):
    return policy.predict_action(obs, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def openpi_session(served, policy, tiny_checkpoint, tmp_path_factory):
    """One session of the unmodified openpi-client against the server (see OPENPI_SESSION)."""
    python = openpi_python()
    proc, port = served
    folder = tmp_path_factory.mktemp("openpi")
    obs = observations(tiny_checkpoint.dataset, policy)
    np.savez(folder / "inputs.npz", seeds=np.array(SEEDS),
             **{f"obs{i}_{k}": v for i, o in enumerate(obs) for k, v in o.items()})
    script = folder / "session.py"
    script.write_text(OPENPI_SESSION)
    run = subprocess.run([str(python), str(script), str(port), str(folder / "inputs.npz"), str(folder / "out")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads((folder / "out.json").read_text())
    return result, dict(np.load(folder / "out.npz")), obs


def test_metadata_on_connect(openpi_session, tiny_checkpoint):
    meta = openpi_session[0]["metadata"]
    assert meta["checkpoint_sha256"] == hashlib.sha256(tiny_checkpoint.checkpoint.read_bytes()).hexdigest()
    assert meta["dataset_sha256"] == hashlib.sha256(tiny_checkpoint.dataset.read_bytes()).hexdigest()
    # the demo config: low-dimensional only, To=2, H=8, 4 executed; the synthetic data is 10 Hz
    assert (meta["n_obs_steps"], meta["horizon"], meta["n_action_steps"]) == (2, 8, 4)
    assert meta["frequency_hz"] == 10.0 and meta["action_dt_s"] == pytest.approx(0.1)
    assert meta["observation"] == {
        POS_KEY: {"shape": [3], "dtype": "float64", "kind": "stream"},
        ROT_KEY: {"shape": [3], "dtype": "float64", "kind": "stream"},
        GRIPPER_KEY: {"shape": [1], "dtype": "float64", "kind": "stream"},
    }
    assert meta["latency_s"] == {"camera": 0.0, "robot": 0.0, "gripper": 0.0}
    assert meta["protocol"] == "openpi-websocket"


def test_openpi_client_gets_the_in_process_actions(openpi_session, policy):
    result, arrays, obs = openpi_session
    for i, seed in enumerate(SEEDS):
        want = in_process(policy, obs[i], seed)
        np.testing.assert_allclose(arrays[f"aligned{i}_action"], want["action"], atol=1e-6, rtol=0)
        # action k is for the newest frame's time + k / 10 Hz
        np.testing.assert_allclose(arrays[f"aligned{i}_timestamp"], obs[i]["timestamp"][-1] + np.arange(8) * 0.1)
        timing = result[f"timing{i}"]
        assert set(timing) == {"decode_ms", "preprocess_ms", "queue_ms", "inference_ms", "postprocess_ms", "total_ms",
                               "batch_size"}
        assert 0 < timing["inference_ms"] < timing["total_ms"] and timing["batch_size"] == 1
    # streams stamped on the dataset grid align to exactly the same observation (no latency in this config)
    np.testing.assert_allclose(arrays["streams0_action"], arrays["aligned0_action"], atol=1e-12, rtol=0)
    np.testing.assert_array_equal(arrays["streams0_timestamp"], arrays["aligned0_timestamp"])


def test_bad_requests_get_an_error_and_the_server_keeps_serving(openpi_session, served, policy):
    result, arrays, obs = openpi_session
    errors = result["errors"]
    assert "observation lacks" in errors["missing key"] and "bad_observation" in errors["missing key"]
    assert "robot0_eef_pos" in errors["wrong shape"]
    assert "holds 5 steps" in errors["wrong step count"]
    assert "must be a map" in errors["not a map"]
    assert "stale_observation" in errors["stale"] and "older than the 1 s accepted" in errors["stale"]
    assert "strictly increasing" in errors["unordered"]
    assert "either streams" in errors["mixed kinds"]
    assert errors["garbage"].startswith("error (bad_observation): frame is not valid msgpack")
    assert "text frame" in errors["text frame"]
    assert "error (bad_observation): unknown request key ['now']: a request holds" in errors["misspelt now_s"]
    want = in_process(policy, obs[0], SEEDS[0])["action"]
    np.testing.assert_allclose(arrays["text_keys_action"], want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(arrays["after_garbage_action"], want, atol=1e-6, rtol=0)
    np.testing.assert_allclose(arrays["after_errors_action"], want, atol=1e-6, rtol=0)
    assert served[0].poll() is None, "the server died"


def test_two_clients_at_once_are_batched_and_each_gets_its_own_answer(openpi_session, policy):
    """Requests of two clients stacked into one predict_action call each get what they get alone."""
    result, arrays, obs = openpi_session
    assert 2 in result["batch_sizes"], result["batch_sizes"]
    for k, name in enumerate(("A", "B"), start=1):
        for j in range(6):
            want = in_process(policy, obs[j % len(SEEDS)], 100 * k + j)["action"]
            np.testing.assert_allclose(arrays[f"{name}{j}_action"], want, atol=1e-6, rtol=0)
    a, b = result["times"]["A"], result["times"]["B"]
    assert a[0] < b[-1] and b[0] < a[-1], "one client was served only after the other had finished"


def test_a_batch_with_a_generator_per_observation_equals_each_alone(policy, tiny_checkpoint):
    obs = observations(tiny_checkpoint.dataset, policy)
    stacked = {k: np.stack([o[k] for o in obs]) for k in obs[0]}
    got = policy.predict_action(stacked, generator=[torch.Generator().manual_seed(s) for s in SEEDS], frame="dataset")
    for i, seed in enumerate(SEEDS):
        want = policy.predict_action(obs[i], generator=torch.Generator().manual_seed(seed), frame="dataset")
        for key in want:
            np.testing.assert_allclose(got[key][i], want[key], atol=1e-6, rtol=0)
    one = policy.predict_action(stacked, generator=torch.Generator().manual_seed(0))["action"]
    assert not np.allclose(one[1], got["action"][1]), "one generator for the batch gave the per-observation noise"
    with pytest.raises(ValueError, match="2 generators for a batch of 3"):
        policy.predict_action(stacked, generator=[torch.Generator(), torch.Generator()])


def test_remote_policy_matches_the_in_process_policy(served, policy, tiny_checkpoint):
    from dpflow_core.serving.client import RemotePolicy, ServingError

    obs = observations(tiny_checkpoint.dataset, policy)
    with RemotePolicy(f"ws://127.0.0.1:{served[1]}") as remote:
        for name in ("n_obs_steps", "horizon", "action_dt_s", "frequency_hz"):
            assert getattr(remote, name) == getattr(policy, name)
        for frame in ("tcp", "dataset"):
            got = remote.predict_action(obs[1], frame=frame, noise_seed=3)
            want = policy.predict_action(obs[1], generator=torch.Generator().manual_seed(3), frame=frame)
            assert set(got) == set(want)
            for key in want:
                np.testing.assert_allclose(got[key], want[key], atol=1e-6, rtol=0)
        assert remote.last_timing["network_ms"] > 0
        stale_now = obs[1]["timestamp"][-1] + 5.0
        with pytest.raises(ServingError, match="stale_observation"):
            remote.predict_action(obs[1], now_s=stale_now)


class FaultyPolicy:
    """The real policy, except that its next ``predict_action`` calls raise and its next ``check_obs``
    calls hand back arrays the batcher cannot stack (a fault outside inference), as many as asked."""

    def __init__(self, policy):
        self.policy, self.failing_predictions, self.unstackable_checks = policy, 0, 0

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def check_obs(self, obs):
        arrays, batched = self.policy.check_obs(obs)
        if self.unstackable_checks:
            self.unstackable_checks -= 1
            arrays = {k: a.tolist() for k, a in arrays.items()}
        return arrays, batched

    def predict_action(self, *args, **kwargs):
        if self.failing_predictions:
            self.failing_predictions -= 1
            raise RuntimeError("injected inference fault")
        return self.policy.predict_action(*args, **kwargs)


def test_a_failed_batch_answers_its_requests_with_the_error_and_the_next_batch_is_served(policy, tiny_checkpoint):
    """The server in this process, on the real policy wrapped to fail once in inference and once around it."""
    import asyncio
    import queue
    import threading

    from dpflow_core.serving.client import RemotePolicy, ServingError
    from dpflow_core.serving.server import load_server

    server = load_server(tiny_checkpoint.checkpoint, ServeSettings(port=0))
    server.policy = faulty = FaultyPolicy(server.policy)
    bound, running = queue.Queue(), {}

    async def main():
        running["loop"], running["stop"] = asyncio.get_running_loop(), asyncio.Event()
        await server.run("127.0.0.1", 0, ready=lambda host, port: bound.put(port), stop=running["stop"])

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    obs = observations(tiny_checkpoint.dataset, policy)[1]
    try:
        with RemotePolicy(f"ws://127.0.0.1:{bound.get(timeout=30)}", timeout_s=10) as remote:
            faulty.failing_predictions = 1
            with pytest.raises(ServingError, match=r"error \(internal\): RuntimeError: injected inference fault"):
                remote.predict_action(obs, noise_seed=3)
            faulty.unstackable_checks = 1
            with pytest.raises(ServingError, match=r"error \(internal\): AttributeError: .*'list'.*'shape'"):
                remote.predict_action(obs, noise_seed=3)
            got = remote.predict_action(obs, noise_seed=3)
        want = in_process(policy, obs, 3)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], atol=1e-6, rtol=0)
        assert server.requests_served == 1 and thread.is_alive()
    finally:
        running["loop"].call_soon_threadsafe(running["stop"].set)
        thread.join(timeout=10)
    assert not thread.is_alive()


def test_robot_client_example_runs_with_openpi_client(served, tiny_checkpoint):
    run = subprocess.run([str(openpi_python()), str(REPO / "examples" / "robot_client.py"), "--port", str(served[1]),
                          "--dataset", str(tiny_checkpoint.dataset), "--cycles", "2"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("server dpflow") and len(lines) == 3
    assert lines[1].startswith("step 0: ") and lines[2].startswith("step 4: ") and "network" in lines[2]


# ---------------------------------------------------------------- the timing contract, no server


def _fake_policy(spec: ObsActionSpec, frequency_hz: float = 10.0):
    return SimpleNamespace(spec=spec, frequency_hz=frequency_hz)


LATENCY_SPEC = ObsActionSpec(
    rgb_keys=("camera0_rgb",), n_obs_steps=3, obs_down_sample_steps=2,
    obs_latency_steps={POS_KEY: 1.25, ROT_KEY: 1.25, GRIPPER_KEY: 0.5},
)


def _episode(t: int = 30):
    rng = np.random.default_rng(4)
    rot = (Rotation.from_rotvec([0.1, -0.2, 0.3]) * Rotation.from_rotvec(np.cumsum(rng.normal(0, 0.05, (t, 3)), 0)))
    frames = np.zeros((t, 4, 4, 3), np.uint8)
    frames[:, 0, 0, 0] = np.arange(t)  # a frame says which step it is
    return {
        "camera0_rgb": frames,
        POS_KEY: np.cumsum(rng.normal(0, 0.01, (t, 3)), 0),
        ROT_KEY: rot.as_rotvec(),
        GRIPPER_KEY: 0.04 + 0.02 * np.sin(np.arange(t) / 3)[:, None],
    }


@pytest.mark.parametrize("anchor", [1, 12, 25])
def test_alignment_equals_the_training_sampler(anchor):
    """Streams stamped at capture time cut the sample training cuts (latency shifts, slerp, edge padding)."""
    ep, spec, f = _episode(), LATENCY_SPEC, 10.0
    ts = 50.0 + np.arange(30) / f
    jitter = np.random.default_rng(1).uniform(-0.02, 0.02, 30)  # camera clock jitter under half a period
    # at the anchor's action time the camera has shown up to the anchor, the pose 2 steps more, the gripper 1
    newest = {"camera0_rgb": anchor, POS_KEY: anchor + 2, ROT_KEY: anchor + 2, GRIPPER_KEY: anchor + 1}
    streams = {k: {"timestamp": (ts + (jitter if k == "camera0_rgb" else 0))[:n + 1], "value": ep[k][:n + 1]}
               for k, n in newest.items()}
    streams["camera0_rgb"]["timestamp"][-1] = ts[anchor]
    got = align_observation(streams, _fake_policy(spec), now_s=ts[anchor] + 0.2)

    rows = np.array([[anchor, 0, 30]])
    want = read_raw(lowdim_arrays(ep, spec), spec, rows)
    for key in (POS_KEY, ROT_KEY, GRIPPER_KEY):
        np.testing.assert_allclose(got[key], want[key][0], atol=1e-12, rtol=0)
    frame_steps = obs_positions(spec, "camera0_rgb", rows)[0].astype(int)
    np.testing.assert_array_equal(got["camera0_rgb"][:, 0, 0, 0], frame_steps)
    np.testing.assert_allclose(got["timestamp"], ts[anchor] - np.array([4, 2, 0]) / f)


def test_alignment_of_analytic_motion_at_irregular_pose_times():
    """Constant velocity and constant turn rate: the shifted reads are exact wherever the samples fall."""
    spec, f = LATENCY_SPEC, 10.0
    v, w = np.array([0.1, -0.2, 0.05]), 0.4  # m/s, rad/s about z
    pose_t = np.sort(np.random.default_rng(2).uniform(0.0, 3.0, 40))
    cam_t = np.arange(0.0, 2.51, 0.1)
    streams = {
        "camera0_rgb": {"timestamp": cam_t, "value": np.zeros((len(cam_t), 4, 4, 3), np.uint8)},
        POS_KEY: {"timestamp": pose_t, "value": pose_t[:, None] * v},
        ROT_KEY: {"timestamp": pose_t, "value": np.outer(pose_t, [0, 0, w])},
        GRIPPER_KEY: {"timestamp": pose_t, "value": 0.01 + 0.005 * pose_t[:, None]},
    }
    got = align_observation(streams, _fake_policy(spec), now_s=3.05)
    frames_t = 2.5 - np.array([0.4, 0.2, 0.0])
    np.testing.assert_allclose(got["timestamp"], frames_t)
    np.testing.assert_allclose(got[POS_KEY], (frames_t + 0.125)[:, None] * v, atol=1e-12)
    np.testing.assert_allclose(got[ROT_KEY], np.outer(frames_t + 0.125, [0, 0, w]), atol=1e-12)
    np.testing.assert_allclose(got[GRIPPER_KEY], 0.01 + 0.005 * (frames_t + 0.05)[:, None], atol=1e-12)


def test_alignment_refusals():
    spec, f = LATENCY_SPEC, 10.0
    ep = _episode()
    ts = np.arange(30) / f

    def streams(n=20, **changes):  # the pose and gripper 2 steps newer than the frames, as their latency shifts need
        s = {k: {"timestamp": ts[:n + (1 if k == "camera0_rgb" else 3)], "value": v[:n + (1 if k == "camera0_rgb" else 3)]}
             for k, v in ep.items()}
        return s | changes

    policy = _fake_policy(spec)
    with pytest.raises(StaleObservationError, match="older than the 1 s accepted"):
        align_observation(streams(), policy, now_s=ts[20] + 1.5)
    with pytest.raises(StaleObservationError, match="one clock"):
        align_observation(streams(), policy, now_s=ts[20] - 0.5)
    now = ts[22]  # the newest pose sample
    late = {"timestamp": ts[:18], "value": ep[POS_KEY][:18]}  # newest pose 2 steps before the frame
    with pytest.raises(StaleObservationError, match="robot0_eef_pos.*newest sample is 0.4250 s older"):
        align_observation(streams(**{POS_KEY: late}), policy, now_s=now)
    with pytest.raises(ObservationError, match=r"lacks streams \['robot0_gripper_width'\]"):
        align_observation({k: v for k, v in streams().items() if k != GRIPPER_KEY}, policy, now_s=now)
    with pytest.raises(ObservationError, match=r"must be numeric \(N, 3\)"):
        align_observation(streams(**{POS_KEY: {"timestamp": ts[:23], "value": np.zeros((23, 4))}}), policy, now)
    with pytest.raises(ObservationError, match="strictly increasing"):
        align_observation(streams(**{GRIPPER_KEY: {"timestamp": ts[:21][::-1], "value": ep[GRIPPER_KEY][:21]}}),
                          policy, now)
    gap = np.r_[0:14, 18:21]  # frames 14-17 lost: step 16 (anchor - 4) has none within 0.05 s
    cam = {"timestamp": ts[gap], "value": ep["camera0_rgb"][gap]}
    with pytest.raises(ObservationError, match="no frame within half a period"):
        align_observation(streams(**{"camera0_rgb": cam}), policy, now)
    with pytest.raises(ObservationError, match=r"trained on \(8, 8, 3\)"):
        align_observation(streams(), policy, now, image_shapes={"camera0_rgb": (8, 8, 3)})


def test_actions_to_execute_drops_the_past():
    times = 10.0 + np.arange(8) * 0.1
    np.testing.assert_array_equal(actions_to_execute(times, now_s=10.25, exec_latency_s=0.01), [3, 4, 5, 6, 7])
    np.testing.assert_array_equal(actions_to_execute(times, now_s=9.0), np.arange(8))
    assert len(actions_to_execute(times, now_s=11.0)) == 0


def test_settings_bind_loopback_by_default_and_refuse_bad_values():
    from dpflow_core.serving.settings import is_loopback

    assert ServeSettings().host == "127.0.0.1" and ServeSettings().loopback
    assert [is_loopback(h) for h in ("localhost", "127.0.0.2", "::1", "0.0.0.0", "192.168.1.5", "robot.lab")] == [
        True, True, True, False, False, False]
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        ServeSettings(port=70000)
    with pytest.raises(ValueError, match="max_age_s must be a positive"):
        ServeSettings(max_age_s=0)
    with pytest.raises(ValueError, match="batch_window_s must be a non-negative"):
        ServeSettings(batch_window_s=-0.01)
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        ServeSettings(max_batch=0)


# every field away from its default: a field added to ServeSettings must be added here (and to the CLI)
NON_DEFAULT_SETTINGS = dict(host="0.0.0.0", port=0, device="cuda:1", max_age_s=0.35, threads=3,
                            batch_window_s=0.0125, max_batch=4, mkldnn=True)


@pytest.mark.parametrize("settings", [ServeSettings(), ServeSettings(**NON_DEFAULT_SETTINGS),
                                      ServeSettings(port=9001, max_batch=1, batch_window_s=0.0)],
                         ids=["defaults", "every-field", "some"])
def test_the_printed_serve_command_rebuilds_its_settings(settings, monkeypatch, tmp_path):
    """What the Dagster checkpoint asset shows, parsed by the real `dpflow serve` options, is the same settings."""
    import dataclasses

    import dpflow_core.serving.server as server
    from typer.testing import CliRunner

    from dpflow_core.cli import app

    assert set(NON_DEFAULT_SETTINGS) == {f.name for f in dataclasses.fields(ServeSettings)}, \
        "a ServeSettings field without a non-default value here (and maybe without its dpflow serve option)"
    assert all(NON_DEFAULT_SETTINGS[f.name] != f.default for f in dataclasses.fields(ServeSettings))
    served = []
    monkeypatch.setattr(server, "serve", lambda checkpoint, given, ready=None: served.append((checkpoint, given)))
    checkpoint = tmp_path / "a run" / "epoch=0119-train_loss=0.01.ckpt"  # a space and '=' as a shell must quote them
    command = shlex.split(serve_command(checkpoint, settings))
    assert command[:3] == ["dpflow", "serve", str(checkpoint)]
    result = CliRunner().invoke(app, command[1:])
    assert result.exit_code == 0, result.output
    assert served == [(checkpoint, settings)]


def test_a_rollout_through_the_server_is_the_rollout_in_process(served, policy):
    """`dpflow rollout --server`: the closed-loop world driven through `dpflow serve` moves the gripper as the
    in-process policy does on the same held-out states: two episodes in lockstep, their batch sent as one
    request with the decision's noise seed."""
    from dpflow_core.serving.client import RemotePolicy
    from dpflow_core.sim.rollout import eval_seeds, rollout_policy

    _, port = served
    seeds = eval_seeds(2, seed=4)
    tracks = {"local": ([], []), "through": ([], [])}

    def track(name):  # the gripper after every controller step: any difference in a chunk moves it
        return lambda i, world: tracks[name][i].append(np.r_[world.gripper.pos, world.gripper.rotvec,
                                                                world.gripper.opening])

    threads, mkldnn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    # the server's float arithmetic (its threads, no oneDNN): float32 rounding differences grow in closed loop
    torch.set_num_threads(ServeSettings().threads)
    torch.backends.mkldnn.enabled = ServeSettings().mkldnn
    try:
        local = rollout_policy(policy, "stack", seeds, video=track("local"), video_episodes=2)
    finally:
        torch.set_num_threads(threads)
        torch.backends.mkldnn.enabled = mkldnn
    with RemotePolicy(f"ws://127.0.0.1:{port}") as remote:
        through = rollout_policy(remote, "stack", seeds, video=track("through"), video_episodes=2)
    strip = lambda r: {k: v for k, v in r.__dict__.items() if k != "predict_s"}  # noqa: E731
    assert [strip(r) for r in through] == [strip(r) for r in local]
    assert all(r.decisions > 10 for r in local)
    for i in range(2):
        here, there = np.array(tracks["local"][i]), np.array(tracks["through"][i])
        assert len(here) > 100 and np.ptp(here[:, :3], axis=0).max() > 0.01, "the gripper never moved"
        np.testing.assert_allclose(there, here, atol=1e-6, rtol=0)


def test_the_metadata_names_the_task_and_rollout_through_a_server_refuses_another(policy, tmp_path, monkeypatch):
    """The server says which task its policy was trained on (the dataset's sidecar, when it is on the server);
    `dpflow rollout --server` refuses a --task that differs, as it does in process."""
    import copy

    from typer.testing import CliRunner

    from dpflow_core.cli import app
    from dpflow_core.serving import client as serving_client
    from dpflow_core.serving.server import policy_metadata

    (tmp_path / "dataset.json").write_text(json.dumps({"task": "pick_place"}))
    here = copy.copy(policy)
    here.dataset = {**policy.dataset, "path": str(tmp_path / "dataset.npz")}
    meta = policy_metadata(here, "0" * 64, {}, 1.0)
    assert meta["task"] == "pick_place"
    assert policy_metadata(policy, "0" * 64, {}, 1.0)["task"] is None  # the synthetic dataset has no sidecar

    class Served:  # what RemotePolicy knows of a server before any rollout: its metadata
        def __init__(self, url):
            self.metadata = meta

    monkeypatch.setattr(serving_client, "RemotePolicy", Served)
    out = CliRunner().invoke(app, ["rollout", "--server", "ws://127.0.0.1:9", "--task", "stack", "-n", "1",
                                   "-o", str(tmp_path / "r")])
    assert out.exit_code == 2 and "was trained on task 'pick_place'" in out.output and "as the server says" in out.output
    assert not (tmp_path / "r").exists()


def test_a_port_in_use_is_reported_before_the_checkpoint_loads(tiny_checkpoint):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run([str(VENV_BIN / "dpflow"), "serve", str(tiny_checkpoint.checkpoint), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use (errno 98)" in run.stderr
    assert "loading" not in run.stderr  # nothing was loaded


@pytest.mark.parametrize("step", [2, 13, 27])
def test_the_robot_client_example_replays_rows_as_training_paired_them(step):
    """examples/robot_client.py's requests: each stream delivers rows as late as its trained latency (camera
    0.125 s, gripper 0.075 s, pose on time), stamped at capture time; aligned by the server they are the
    sample training cuts at the newest delivered frame, row ``step - 2`` (frames, shifted poses, widths)."""
    import importlib.util

    spec_ = importlib.util.spec_from_file_location("robot_client", REPO / "examples" / "robot_client.py")
    example = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(example)  # importable without openpi-client: it is imported in main()
    ep, spec, f = _episode(), LATENCY_SPEC, 10.0
    latency = {"camera0_rgb": 0.125, POS_KEY: 0.0, ROT_KEY: 0.0, GRIPPER_KEY: 0.075}
    assert example.first_step(f, latency) == 2
    now = 1000.0 + step / f
    request = example.request_at(ep, step, 8, f, now, latency)
    assert request["camera0_rgb"]["value"][-1, 0, 0, 0] == step - 2 and len(request[POS_KEY]["value"]) == min(step + 1, 8)
    got = align_observation(request, _fake_policy(spec), now_s=now)
    anchor = step - 2
    rows = np.array([[anchor, 0, 30]])
    want = read_raw(lowdim_arrays(ep, spec), spec, rows)
    for key in (POS_KEY, ROT_KEY, GRIPPER_KEY):
        np.testing.assert_allclose(got[key], want[key][0], atol=1e-9, rtol=0)
    np.testing.assert_array_equal(got["camera0_rgb"][:, 0, 0, 0], obs_positions(spec, "camera0_rgb", rows)[0].astype(int))
    # the old replay (every stream up to row `step`, the frame stamped a latency early) pairs other rows
    old = {k: {"timestamp": now - latency[k] - (step - np.arange(max(0, step - 7), step + 1)) / f,
               "value": v[max(0, step - 7):step + 1]} for k, v in ep.items()}
    wrong = align_observation(old, _fake_policy(spec), now_s=now)
    assert np.abs(wrong[POS_KEY] - want[POS_KEY][0]).max() > 1e-4
