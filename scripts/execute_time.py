"""Time `execute` per request (DeepFM, batch 1, sequential HTTP requests) from the model's
own opara_execute_seconds_total metrics: `python scripts/execute_time.py [REQUESTS]`.

Run it with the venv of the checkout to measure (the server's stubs import that
checkout's code); it imports the launcher of either layout, so a checkout from before
the planning/engine/serving split (92a4b09) can be measured against a newer one. The
sleeps let the model push its counts, which older checkouts only did inside execute.
"""
import re, shutil, sys, tempfile, time, urllib.request
from pathlib import Path
try:
    from opara_core.serving.launcher import ServerConfig, TritonServer, free_port, REPO_ROOT
except ImportError:  # before the planning/engine/serving layout
    from opara_core.server import ServerConfig, TritonServer, free_port, REPO_ROOT
import tritonclient.http as http
from opara_core import zoo

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
root = Path(tempfile.mkdtemp())
shutil.copytree(REPO_ROOT / "model_repository" / "deepfm", root / "deepfm")
config = ServerConfig(model_repository=root, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
with TritonServer(config, root / "server.log") as server:
    client = http.InferenceServerClient(server.http_url)
    entry = zoo.get("deepfm")
    inputs = []
    for spec, x in zip(entry.inputs, entry.example_inputs(1, seed=3)):
        i = http.InferInput(spec.name, list(x.shape), "FP32" if x.dtype.is_floating_point else "INT64")
        i.set_data_from_numpy(x.numpy(), binary_data=True)
        inputs.append(i)
    for _ in range(50):
        client.infer("deepfm", inputs)
    def scrape():
        text = urllib.request.urlopen(server.metrics_url).read().decode()
        secs = {k: float(v) for k, v in re.findall(r'^opara_execute_seconds_total\{model="deepfm",stage="(\w+)"\} (\S+)$', text, re.M)}
        reqs = float(re.search(r'^opara_requests_total\{model="deepfm"\} (\S+)$', text, re.M).group(1))
        return secs, reqs
    time.sleep(0.7); client.infer("deepfm", inputs); time.sleep(0.7)
    before = scrape()
    start = time.perf_counter()
    for _ in range(N):
        client.infer("deepfm", inputs)
    wall = time.perf_counter() - start
    time.sleep(0.7); client.infer("deepfm", inputs); time.sleep(0.7)
    after = scrape()
    n = after[1] - before[1]
    per = {k: 1000 * (after[0][k] - before[0][k]) / n for k in after[0]}
    print(f"requests {n:.0f}; execute ms per request: " + ", ".join(f"{k} {v:.4f}" for k, v in per.items()) + f"; total {sum(per.values()):.4f}; client wall {1000 * wall / N:.3f} ms")
    client.close()
