"""The GenEval side of the fault / resume e2e test (tests/e2e/test_train_tiny_on_cpu.py): a tiny prompt file with
GenEval ground truth per row and a loopback GenEval server that can die mid-run. Shared with the uninterrupted
reference run in the e2e suite's Ray session (tests/e2e/session_smoke.py)."""

import json


def geneval_prompts(path):
    """Tiny prompt file with GenEval ground truth per row (the server below scores coloured boxes)."""
    metas = [{"tag": "colors", "include": [{"class": "cup", "count": 1, "color": c}], "prompt": f"a photo of a {c} cup"}
             for c in ("red", "green", "blue", "yellow", "purple", "orange", "pink", "black")]
    with open(path, "w") as f:
        for m in metas:
            f.write(json.dumps({"prompt": m["prompt"], "reward_model": {"ground_truth": json.dumps(m)}}) + "\n")
    return str(path)


def geneval_server(die_after_train_requests=None, fail_train_requests=False):
    """A loopback GenEval server (coloured-box scorer). With ``die_after_train_requests=k`` it stops listening while
    answering the k-th training request (32 images), so the run's step k+1 is the first to find it gone. With
    ``fail_train_requests`` it answers every training request with HTTP 500 (the preflight check still passes)."""
    import threading
    from http.server import ThreadingHTTPServer

    from verl_diffusion.rewards.geneval_server import ColorBlobScorer, _handler

    scorer, seen = ColorBlobScorer({"cup": (200, 0, 200)}), []

    def score(images, metas, only_strict):
        if fail_train_requests and len(images) == 32:
            raise RuntimeError("this test server fails every training request")
        out = scorer(images, metas, only_strict)
        if die_after_train_requests and len(images) == 32:
            seen.append(1)
            if len(seen) == die_after_train_requests:     # gone before this reply is sent: no race with step k+1
                srv.shutdown()                              # (this handler runs in its own thread)
                srv.server_close()
        return out

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(score))
    srv.daemon_threads = True
    threading.Thread(target=lambda: srv.serve_forever(poll_interval=0.05), daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"
