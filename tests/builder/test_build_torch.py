"""build.training_model against PyTorch itself (skipped where torch is not installed).

The same MLP, data and hyperparameters are trained by torch.optim and by the
built ONNX training model on onnxruntime; the parameters must agree after
every step.  tests/builder/test_build.py checks the same against a numpy
transcription of torch's rules, so it runs without torch."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_build import affine, blobs, initial_params, mlp, need_rules  # noqa: E402

from onnxtrain import TrainingSession, build  # noqa: E402

F = torch.nn.functional
torch.set_num_threads(1)  # tiny tensors: threads only cost time on a shared machine
STEPS = 50
NAMES = ("W1", "b1", "W2", "b2")

OPTIMIZERS = {
    "sgd": (build.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_wd": (build.SGD(lr=0.1, weight_decay=0.01), lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01)),
    "momentum": (build.SGD(lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "nesterov_wd": (build.SGD(lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3),
                    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3)),
    "adagrad": (build.Adagrad(lr=0.1, lr_decay=0.01, weight_decay=1e-3, initial_accumulator_value=0.1),
                lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, weight_decay=1e-3,
                                               initial_accumulator_value=0.1)),
    "adam": (build.Adam(lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01)),
    "adam_wd": (build.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01),
                lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01)),
    "adamw": (build.AdamW(lr=0.01, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
}


def torch_params(model):
    return {k: torch.tensor(v, dtype=torch.float32, requires_grad=True)
            for k, v in initial_params(model).items()}


def torch_logits(p, x):
    return F.relu(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]


def torch_trajectory(model, make_optimizer, x, labels, steps, scheduler=None, clip=None):
    p = torch_params(model)
    opt = make_optimizer([p[k] for k in NAMES])
    sched = scheduler(opt) if scheduler else None
    xt, yt = torch.tensor(x), torch.tensor(labels)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(torch_logits(p, xt), yt).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p[k] for k in NAMES], clip)
        opt.step()
        if sched is not None:
            sched.step()
        out.append({k: p[k].detach().numpy().astype(np.float64) for k in NAMES})
    return out


def onnx_trajectory(tm, x, labels, steps):
    sess = TrainingSession(tm)
    out = []
    for _ in range(steps):
        sess.train_step({"X": x, "target": labels}, fetch=False)
        out.append({k: sess.state[k].astype(np.float64) for k in NAMES})
    return out


def assert_close(got, expected, rtol=1e-4, atol=1e-6):
    for step, (g, e) in enumerate(zip(got, expected)):
        for k in e:
            np.testing.assert_allclose(g[k], e[k], rtol=rtol, atol=atol, err_msg=f"step {step}, {k}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_trajectory_matches_torch(name):
    optimizer, make = OPTIMIZERS[name]
    model = mlp()
    x, labels = blobs()
    expected = torch_trajectory(model, make, x, labels, STEPS)
    got = onnx_trajectory(build.training_model(model, optimizer=optimizer), x, labels, STEPS)
    assert_close(got, expected)


@pytest.mark.parametrize("name", ["lambda_cosine_warmup", "cosine", "step", "warmup"])
def test_schedule_matches_torch_scheduler(name):
    sched = torch.optim.lr_scheduler
    schedule, scheduler = {
        "lambda_cosine_warmup": (build.cosine(40, warmup=5), None),
        # CosineAnnealingLR rises again after T_max; build.cosine holds 0 there: compare up to T_max
        "cosine": (build.cosine(STEPS), lambda opt: sched.CosineAnnealingLR(opt, T_max=STEPS)),
        "step": (build.step_decay(7, 0.5), lambda opt: sched.StepLR(opt, step_size=7, gamma=0.5)),
        "warmup": (build.linear_warmup(10), None),
    }[name]
    if scheduler is None:  # LambdaLR with the schedule's own formula
        scheduler = lambda opt: sched.LambdaLR(opt, schedule.factor)  # noqa: E731
    model = mlp()
    x, labels = blobs()
    expected = torch_trajectory(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), x, labels, STEPS,
                                scheduler=scheduler)
    tm = build.training_model(model, optimizer=build.SGD(lr=0.1, momentum=0.9), schedule=schedule)
    assert_close(onnx_trajectory(tm, x, labels, STEPS), expected)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_clip_grad_norm_matches_torch(name):
    optimizer, make = OPTIMIZERS[name]
    model = mlp()
    x, labels = blobs()
    expected = torch_trajectory(model, make, x, labels, 30, clip=0.3)
    got = onnx_trajectory(build.training_model(model, optimizer=optimizer, clip_grad_norm=0.3), x, labels, 30)
    assert_close(got, expected)


def test_accumulate_matches_torch_accumulation():
    """torch: (loss / k).backward() over k micro-batches, clip, step; onnx: accumulate=k."""
    k = 3
    model = mlp()
    x, labels = blobs(n=24)
    p = torch_params(model)
    opt = torch.optim.Adam([p[n] for n in NAMES], lr=0.01)
    tm = build.training_model(model, optimizer=build.Adam(lr=0.01), accumulate=k, clip_grad_norm=0.5)
    cycle = json.loads(dict((m.key, m.value) for m in tm.metadata_props)["onnxtrain.cycle"])
    sess = TrainingSession(tm)
    for _ in range(10):
        opt.zero_grad()
        for i, algorithm in enumerate(cycle):
            part = slice(8 * i, 8 * (i + 1))
            (F.cross_entropy(torch_logits(p, torch.tensor(x[part])), torch.tensor(labels[part])) / k).backward()
            sess.train_step({"X": x[part], "target": labels[part]}, algorithm=algorithm, fetch=False)
        torch.nn.utils.clip_grad_norm_([p[n] for n in NAMES], 0.5)
        opt.step()
    for n in NAMES:
        np.testing.assert_allclose(sess.state[n], p[n].detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=n)


def test_batch_norm_train_mode_matches_torch():
    """Parameters and running mean follow torch (ONNX momentum m is torch's 1 - m).
    The running variance differs by design: ONNX uses the biased batch variance,
    torch the unbiased one."""
    need_rules("BatchNormalization")
    model = mlp(dtype=np.float64, batch_norm=True)
    x, labels = blobs(dtype=np.float64)
    sess = TrainingSession(build.training_model(model, optimizer=build.SGD(lr=0.1, momentum=0.9)))
    p = {k: torch.tensor(v, requires_grad=True) for k, v in initial_params(model).items()}
    bn = ["bn_scale", "bn_bias"]
    opt = torch.optim.SGD([p[n] for n in NAMES + tuple(bn)], lr=0.1, momentum=0.9)
    running_mean = p["bn_mean"].detach().clone()
    running_var = p["bn_var"].detach().clone()
    xt, yt = torch.tensor(x), torch.tensor(labels)
    momentum = 1 - float(np.float32(0.9))  # the node's momentum attribute is a float32
    for _ in range(10):
        opt.zero_grad()
        h = F.batch_norm(xt @ p["W1"] + p["b1"], running_mean, running_var, p["bn_scale"], p["bn_bias"],
                         training=True, momentum=momentum, eps=1e-5)
        F.cross_entropy(F.relu(h) @ p["W2"] + p["b2"], yt).backward()
        opt.step()
        sess.train_step({"X": x, "target": labels}, fetch=False)
    for n in NAMES + tuple(bn):
        np.testing.assert_allclose(sess.state[n], p[n].detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=n)
    np.testing.assert_allclose(sess.state["bn_mean"], running_mean.numpy(), rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ losses
LOSSES = {
    "mse": ("mse", F.mse_loss, "float"),
    "l1": ("l1", F.l1_loss, "float"),
    "huber": (build.Huber(delta=0.4), lambda p, t: F.huber_loss(p, t, delta=0.4), "float"),
    "bce": (build.BCEWithLogits(pos_weight=[3.0, 0.5]),
            lambda p, t: F.binary_cross_entropy_with_logits(p, t, pos_weight=torch.tensor([3.0, 0.5], dtype=p.dtype)),
            "prob"),
    "cross_entropy": ("cross_entropy", F.cross_entropy, "class"),
    "ce_weight_smoothing": (build.CrossEntropy(label_smoothing=0.15, weight=[0.3, 1.7]),
                            lambda p, t: F.cross_entropy(p, t, weight=torch.tensor([0.3, 1.7], dtype=p.dtype),
                                                         label_smoothing=0.15), "class"),
    "nll": (build.NLL(weight=[2.0, 0.5]),
            lambda p, t: F.nll_loss(F.log_softmax(p, dim=1), t, weight=torch.tensor([2.0, 0.5], dtype=p.dtype)),
            "class"),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_loss_value_and_gradient_match_torch(name):
    loss, torch_loss, kind = LOSSES[name]
    model = affine(head="log_softmax" if name == "nll" else None)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 3))
    t = {"float": lambda: rng.standard_normal((9, 2)), "prob": lambda: rng.random((9, 2)),
         "class": lambda: rng.integers(0, 2, 9).astype(np.int64)}[kind]()
    sess = TrainingSession(build.training_model(model, loss=loss, optimizer=build.SGD(lr=1.0)))
    params = initial_params(model)
    value = float(sess.train_step({"X": x, "target": t})["loss"])

    w = torch.tensor(params["W"], requires_grad=True)
    z = torch.tensor(x) @ w + torch.tensor(params["b"])
    expected = torch_loss(z, torch.tensor(t))
    expected.backward()
    np.testing.assert_allclose(value, expected.item(), rtol=1e-10)
    np.testing.assert_allclose(params["W"] - sess.state["W"], w.grad.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter announces its end
def test_torch_exported_conv_net_trains_like_torch():
    """A torch.onnx export (Conv, BatchNormalization, Gemm) built and trained
    here follows the same torch module trained by torch.optim."""
    need_rules("BatchNormalization")
    import io

    import onnx

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))
    x = torch.randn(16, 1, 6, 6)
    labels = torch.randint(0, 3, (16,))
    with torch.no_grad():  # non-trivial running statistics (fresh ones alias the affine params in export)
        net.train()(x * 2 + 1)
    net.eval()
    buf = io.BytesIO()
    torch.onnx.export(net, (x,), buf, input_names=["X"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"X": {0: "N"}, "logits": {0: "N"}}, dynamo=False,
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    model = onnx.load_from_string(buf.getvalue())
    tm = build.training_model(model, optimizer=build.SGD(lr=0.05, momentum=0.9))
    trainable = json.loads(dict((m.key, m.value) for m in tm.metadata_props)["onnxtrain.trainable"])
    assert sorted(trainable) == sorted(k for k, _ in net.named_parameters())
    sess = TrainingSession(tm)
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(15):
        opt.zero_grad()
        F.cross_entropy(net(x), labels).backward()
        opt.step()
        sess.train_step({"X": x.numpy(), "target": labels.numpy()}, fetch=False)
    for k, v in net.named_parameters():
        np.testing.assert_allclose(sess.state[k], v.detach().numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    np.testing.assert_allclose(sess.state["1.running_mean"], net[1].running_mean.numpy(), rtol=1e-4, atol=1e-5)
