"""Use a finished run: load its final model, score it on held-out text, sample from it.

A run directory written by ``fl-geo run`` (`fl_geo.runtime.session.RunSession`) holds the resolved
``config.yaml`` and the final weights as ``final_model.safetensors`` (when the optional safetensors
package was installed) and ``final_model.pt`` (always). `load_run_model` rebuilds the model exactly
as the ServerApp built it and loads those weights; `evaluate_run` scores it with the evaluator the
run itself used (`GlobalEvaluator`: same held-out windows, same order, so the figure equals the
run's final ``val/loss``); `sample` generates bytes from the built-in byte-level decoder.

Every problem with the directory or its files (missing, unreadable, weights that do not fit the
configured model) is a `ConfigError` with a one-line message naming the file: ``fl-geo eval`` and
``fl-geo sample`` print it and exit with status 2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fl_geo.config import FlGeoConfig, load_config
from fl_geo.core.state import ParamSpec, flatten, unflatten
from fl_geo.data import ByteTokenizer, Tokenizer
from fl_geo.errors import ConfigError
from fl_geo.inner.model import Decoder
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.evaluation import GlobalEvaluator

__all__ = ["RunEval", "evaluate_run", "load_run_model", "load_run_weights", "sample"]

SAFETENSORS_FILE = "final_model.safetensors"
TORCH_FILE = "final_model.pt"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _run_config(run_dir: Path) -> FlGeoConfig:
    if not run_dir.is_dir():
        raise ConfigError(f"run directory not found: {run_dir}")
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"{path}: missing (not a finished fl-geo run directory?)")
    try:
        return load_config(path)
    except ConfigError:
        raise
    except Exception as exc:  # a YAML syntax error is not an omegaconf error: keep it one line
        raise ConfigError(f"{path}: unreadable ({_one_line(exc)})") from None


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # SafetensorError, OSError, ...: a corrupt or truncated file
        raise ConfigError(f"{path}: unreadable safetensors file ({_one_line(exc)})") from None


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError (bad zip), EOFError, ...
        raise ConfigError(f"{path}: unreadable ({_one_line(exc)})") from None
    if not (isinstance(blob, Mapping) and isinstance(blob.get("params"), torch.Tensor)
            and isinstance(blob.get("spec"), str)):
        raise ConfigError(f"{path}: not an fl-geo final model (expected {{'params': flat tensor, 'spec': JSON}})")
    try:
        spec = ParamSpec.from_json(blob["spec"])
        return dict(unflatten(blob["params"].float(), spec))
    except ValueError as exc:
        raise ConfigError(f"{path}: inconsistent flat buffer and layout ({_one_line(exc)})") from None


def load_run_weights(run_dir: str | Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The final weights of a run as ``{name: tensor}`` (CPU) and the file they came from.

    ``final_model.safetensors`` is preferred when it exists and safetensors is installed; otherwise
    ``final_model.pt``. A missing or unreadable file is a `ConfigError` naming it; a corrupt
    safetensors file is reported, never silently replaced by the ``.pt`` one.
    """
    run_dir = Path(run_dir)
    st_path, pt_path = run_dir / SAFETENSORS_FILE, run_dir / TORCH_FILE
    if st_path.is_file():
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            pass
        else:
            return _read_safetensors(st_path), st_path
    if pt_path.is_file():
        return _read_torch(pt_path), pt_path
    if not run_dir.is_dir():
        raise ConfigError(f"run directory not found: {run_dir}")
    raise ConfigError(f"{run_dir}: no {TORCH_FILE} or {SAFETENSORS_FILE} (did the run finish?)")


def _check_fits(model: Decoder, weights: Mapping[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    missing = [n for n in expected if n not in weights]
    unexpected = [n for n in weights if n not in expected]
    if missing or unexpected:
        raise ConfigError(f"{path}: weights do not match the model of config.yaml "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, tensor in expected.items():
        got = tuple(weights[name].shape)
        if got != tuple(tensor.shape):
            raise ConfigError(f"{path}: {name} has shape {got}, the model of config.yaml needs {tuple(tensor.shape)}")
        if not weights[name].is_floating_point():
            raise ConfigError(f"{path}: {name} is {weights[name].dtype}, not a floating-point tensor")


def load_run_model(run_dir: str | Path, device: str | torch.device = "cpu") -> tuple[Decoder, FlGeoConfig]:
    """The final model of a finished run, in eval mode on ``device``, and the run's config.

    The model is built from the run's ``config.yaml`` as the ServerApp builds it
    (``make_model(cfg.model, cfg.run.seed)``), then every parameter is overwritten with the saved
    weights (see `load_run_weights`), whose names and shapes must match the model exactly.
    Raises `ConfigError` (one line, naming the file) for a missing directory, config or weights
    file, an unreadable file, or weights that do not fit the configured model.
    """
    model, cfg, _ = _load_run(Path(run_dir), device)
    return model, cfg


def _load_run(run_dir: Path, device: str | torch.device) -> tuple[Decoder, FlGeoConfig, Path]:
    cfg = _run_config(run_dir)
    weights, path = load_run_weights(run_dir)
    model = make_model(cfg.model, cfg.run.seed)
    _check_fits(model, weights, path)
    model.load_state_dict(OrderedDict((n, weights[n].float()) for n in model.state_dict()), strict=True)
    return model.to(device).eval(), cfg, path


@dataclass(frozen=True)
class RunEval:
    """Validation loss of a run's final model: nats per token (per byte with the byte tokenizer),
    over ``tokens`` held-out targets in ``batches`` batches, weights read from ``weights``."""

    run_dir: Path
    loss: float
    tokens: int
    batches: int
    weights: Path
    bpb: float = float("nan")  # bits per byte of the same batches (fl_geo.runtime.evaluation)


def evaluate_run(run_dir: str | Path, batches: int | None = None) -> RunEval:
    """Score a run's final model on its own held-out text with the run's evaluator.

    ``batches``: the number of validation batches (default the run's ``run.eval_batches``, which
    reproduces the run's final ``val/loss``). Evaluation is on the CPU with the server's thread
    count (``run.server_threads``), like the ServerApp's, so the same batches give the same loss.
    """
    if batches is not None and batches < 1:
        raise ConfigError(f"--batches must be >= 1, got {batches}")
    run_dir = Path(run_dir)
    model, cfg, path = _load_run(run_dir, "cpu")
    if batches is not None:
        cfg.run.eval_batches = int(batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.run.server_threads)
    try:
        # the validation text does not depend on the partition count; run.num_clients is the run's
        evaluator = GlobalEvaluator(cfg, max(1, cfg.run.num_clients))
        loss = evaluator.evaluate(flatten(model.state_dict(), evaluator.spec))
    finally:
        torch.set_num_threads(threads)
    return RunEval(run_dir, loss, evaluator.num_tokens, len(evaluator.batches), path, evaluator.bpb(loss))


@torch.no_grad()
def sample(model: Decoder, prompt: str, tokens: int = 200, temperature: float = 1.0,
           top_k: int = 0, seed: int = 0, tokenizer: Tokenizer | None = None) -> bytes:
    """``prompt``'s UTF-8 bytes followed by ``tokens`` bytes generated one at a time.

    Each step feeds the last ``model.cfg.max_seq_len`` bytes (the context is cropped to what the
    model was built for) and draws the next byte from softmax(logits / ``temperature``), restricted
    to the ``top_k`` most likely bytes when ``top_k`` > 0; ``temperature`` 0 is greedy (argmax).
    Only byte ids (< 256) are ever drawn. Deterministic for a given model, prompt and ``seed``
    (a private generator; the global RNG is untouched). Bad arguments raise `ConfigError`.
    ``tokenizer``: the run's (``data.tokenizer``; default bytes): the prompt is encoded with it,
    ``tokens`` of its ids are drawn (only ids it has) and the text is returned as UTF-8.
    """
    if tokens < 0:
        raise ConfigError(f"--tokens must be >= 0, got {tokens}")
    if not temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = no limit), got {top_k}")
    tok = tokenizer or ByteTokenizer()
    ids = [int(b) for b in tok.encode(prompt)]
    if not ids:
        raise ConfigError("--prompt must not be empty")
    vocab = min(model.cfg.vocab_size, tok.vocab_size)
    if max(ids) >= model.cfg.vocab_size:
        raise ConfigError(f"the prompt has byte {max(ids)}, outside the model's vocabulary of {model.cfg.vocab_size}")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(int(seed))
    was_training = model.training
    model.eval()
    try:
        for _ in range(tokens):
            context = torch.tensor([ids[-model.cfg.max_seq_len:]], dtype=torch.long, device=device)
            logits = model(context)[0, -1, :vocab].float()
            if temperature == 0:
                ids.append(int(logits.argmax()))
                continue
            logits = logits / temperature
            if 0 < top_k < vocab:
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            ids.append(int(torch.multinomial(probs, 1, generator=generator)))
    finally:
        model.train(was_training)
    return bytes(ids) if tokenizer is None else tok.decode(ids).encode("utf-8")
