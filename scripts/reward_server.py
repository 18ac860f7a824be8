#!/usr/bin/env python
"""Launch a GenEval-protocol reward server (the protocol of verl_diffusion/rewards/_protocol.py).

    python scripts/reward_server.py --port 18085                                 # programmatic ColorBlobScorer
    python scripts/reward_server.py --scorer my_pkg.detector:GenEvalDetector --scorer-kwargs '{"device": "cuda"}'

--scorer is ``module:attribute``: a callable ``scorer(images, meta_datas, only_strict)`` returning
``(scores, rewards, strict_rewards, group_rewards, group_strict_rewards)``, or a class (or factory) that
builds one from --scorer-kwargs. Point training at it with
``reward.options.geneval.url=http://HOST:PORT`` (``+reward.options.geneval.url=...`` when the recipe lists no
geneval options), or set GENEVAL_REWARD_URL for the geneval recipe. No GPU is needed for the built-in scorer.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
import time


def load_scorer(spec: str, kwargs: dict):
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"--scorer {spec!r} must look like module:attribute")
    obj = getattr(importlib.import_module(module_name), attr)
    if inspect.isclass(obj) or kwargs:
        return obj(**kwargs)
    return obj


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s; 0.0.0.0 to serve a cluster)")
    p.add_argument("--port", type=int, default=18085, help="port (default: %(default)s)")
    p.add_argument("--scorer", default="verl_diffusion.rewards.geneval_server:ColorBlobScorer",
                   help="module:attribute of the scorer (default: %(default)s)")
    p.add_argument("--scorer-kwargs", default="{}", help="JSON keyword arguments for the scorer class")
    args = p.parse_args(argv)

    from verl_diffusion.rewards.geneval_server import serve

    scorer = load_scorer(args.scorer, json.loads(args.scorer_kwargs))
    server, _ = serve(scorer, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"GenEval reward server ({args.scorer}) on http://{host}:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
