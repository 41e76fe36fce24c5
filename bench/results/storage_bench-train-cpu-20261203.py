import json, sys
from pathlib import Path
sys.path.insert(0, "bench"); sys.path.insert(0, ".")
import storage_bench as sb
work = Path("/tmp/storage-bench-k9xcmtj8")
model = Path(json.loads((work / "auto" / "manifest.json").read_text())["capture"]["target"])
steps = int(sys.argv[1])
res = {"command": f"storage_bench.train(work, model, data, storage, {steps}) on the captures of bench/results/storage_bench-cpu-20261203.json",
       "steps": steps}
for name, storage in (("bf16", "auto"), ("fp8", "fp8")):
    res[name] = sb.train(work, model, work / "prepare" / "data.parquet", storage, steps)
    print(name, res[name], flush=True)
Path(sys.argv[2]).write_text(json.dumps(res, indent=2) + "\n")
