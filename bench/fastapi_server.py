#!/usr/bin/python3
"""The baseline kiln is measured against: the encoder served the way many teams serve a
PyTorch model today -- FastAPI + uvicorn + PyTorch eager, one process.

It serves the same Open Inference Protocol v2 REST JSON endpoints as kiln-runtime, so that
`kiln-loadgen --target rest` drives both unchanged:

    POST /v2/models/encoder/infer   {"id", "inputs": [{name, shape, datatype, data}], "outputs"}
    GET  /v2/health/ready, /v2/health/live, /v2/models/encoder/ready

TorchScript weights cannot be loaded into an eager module, so the eager Encoder is rebuilt
from scripts/make_models.py with the seed that produced version V (version 1: seed 1), and on
startup its output is compared with the TorchScript model.pt of that version to prove that it
is the same model.

    /usr/bin/python3 bench/fastapi_server.py --port 8200 --model-repository build/models
"""
import argparse
import os
import sys
import time
from typing import Any, List, Optional

import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
from make_models import Encoder  # noqa: E402  (needs the sys.path entry above)

MODEL_NAME = "encoder"
OUTPUT_NAME = "embedding"
MAX_BATCH_SIZE = 32
INPUT_NAMES = ("input_ids", "attention_mask")


class InferInput(BaseModel):
    name: str
    shape: List[int]
    datatype: str
    data: List[Any]


class RequestedOutput(BaseModel):
    name: str


class InferRequest(BaseModel):
    id: Optional[str] = None
    inputs: List[InferInput]
    outputs: Optional[List[RequestedOutput]] = None


def build_model(version: int) -> torch.nn.Module:
    torch.manual_seed(version)  # make_models.py seeds version V with V
    return Encoder().eval()


def check_against_torchscript(model: torch.nn.Module, repo: str, version: int) -> None:
    """Exits unless the eager model matches the TorchScript model.pt of `version`."""
    path = os.path.join(repo, MODEL_NAME, str(version), "model.pt")
    if not os.path.exists(path):
        print(f"same-model check: SKIPPED ({path} not found)", flush=True)
        return
    scripted = torch.jit.load(path).eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 1000, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 12:] = 0
    with torch.no_grad():
        diff = (model(ids, mask) - scripted(ids, mask)).abs().max().item()
    ok = diff <= 1e-5
    print(f"same-model check: eager Encoder(seed={version}) vs {path}: max |diff| = {diff:.3g} "
          f"-> {'OK' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        sys.exit(1)


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": message})


def make_app(model: torch.nn.Module, version: str, async_endpoint: bool) -> FastAPI:
    app = FastAPI()

    def infer(req: InferRequest):
        by_name = {t.name: t for t in req.inputs}
        tensors = []
        for name in INPUT_NAMES:
            t = by_name.get(name)
            if t is None:
                return error(400, f"missing input '{name}'")
            if t.datatype != "INT64":
                return error(400, f"input '{name}': datatype {t.datatype}, expected INT64")
            if len(t.shape) != 2:
                return error(400, f"input '{name}': shape {t.shape}, expected [batch, seq]")
            try:
                tensors.append(torch.tensor(t.data, dtype=torch.int64).reshape(t.shape))
            except (RuntimeError, TypeError, ValueError) as e:
                return error(400, f"input '{name}': {e}")
        ids, mask = tensors
        if ids.shape != mask.shape:
            return error(400, "input_ids and attention_mask shapes differ")
        if ids.shape[0] > MAX_BATCH_SIZE:
            return error(400, f"batch {ids.shape[0]} exceeds max_batch_size {MAX_BATCH_SIZE}")
        if req.outputs and any(o.name != OUTPUT_NAME for o in req.outputs):
            return error(400, f"unknown output requested (the model has '{OUTPUT_NAME}')")
        with torch.no_grad():
            emb = model(ids, mask)
        return {
            "model_name": MODEL_NAME,
            "model_version": version,
            "id": req.id or "",
            "outputs": [{
                "name": OUTPUT_NAME,
                "shape": list(emb.shape),
                "datatype": "FP32",
                "data": emb.flatten().tolist(),
            }],
        }

    # `def` endpoints run in FastAPI's thread pool (the usual way to serve blocking model
    # code); --async-endpoint runs the model on the event loop instead.
    if async_endpoint:
        @app.post(f"/v2/models/{MODEL_NAME}/infer")
        async def infer_async(req: InferRequest):
            return infer(req)
    else:
        @app.post(f"/v2/models/{MODEL_NAME}/infer")
        def infer_sync(req: InferRequest):
            return infer(req)

    @app.get("/v2/health/ready")
    def ready():
        return {"ready": True}

    @app.get("/v2/health/live")
    def live():
        return {"live": True}

    @app.get(f"/v2/models/{MODEL_NAME}/ready")
    def model_ready():
        return {"name": MODEL_NAME, "ready": True}

    # OIP errors are {"error": "..."}, not FastAPI's {"detail": ...}.
    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        return error(400, f"invalid request: {problems}")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--version", type=int, default=1,
                    help="which make_models.py version (seed) to rebuild")
    ap.add_argument("--model-repository", default=os.path.join(HERE, "..", "build", "models"),
                    help="repository with encoder/V/model.pt for the same-model check")
    ap.add_argument("--async-endpoint", action="store_true",
                    help="run the model inside an async endpoint (on the event loop)")
    args = ap.parse_args()

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    model = build_model(args.version)
    check_against_torchscript(model, args.model_repository, args.version)
    with torch.no_grad():  # one warm-up forward
        model(torch.ones(1, 16, dtype=torch.int64), torch.ones(1, 16, dtype=torch.int64))
    print(f"encoder v{args.version} ready in {time.monotonic() - t0:.2f}s, "
          f"torch threads={torch.get_num_threads()}, serving on {args.host}:{args.port}",
          flush=True)

    app = make_app(model, str(args.version), args.async_endpoint)
    # One uvicorn worker: the usual single-process deployment of a FastAPI model server
    # (more workers would each hold a copy of the model and compete for the same cores).
    uvicorn.run(app, host=args.host, port=args.port, workers=1, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
