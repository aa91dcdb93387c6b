"""One of two processes (jax.distributed, localhost coordinator, 4 simulated CPU devices each) that
run plain decoding and EAGLE-3's dynamic tree over one 2x4 mesh spanning both; each prints what it
read back, for tests/test_sharding.py to compare with one process.
Args: PROCESS_ID PORT [N [--join-only | --with-tree]]."""

import json
import sys

from jspec.loop.sharding import initialize

process_id, port = int(sys.argv[1]), sys.argv[2]
try:
    initialize(f"localhost:{port}", int(sys.argv[3]) if len(sys.argv) > 3 else 2, process_id, timeout_s=60)
except ValueError as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)

import jax  # noqa: E402 (after the runtime joined the other process)

if "--join-only" in sys.argv:
    print(json.dumps({"joined": jax.process_count()}))
    sys.exit(0)

assert (jax.process_count(), jax.local_device_count(), jax.device_count()) == (2, 4, 8)
import mesh_script  # noqa: E402 (builds the same target, drafters and prompts)

from jspec.loop.decode import Decoder  # noqa: E402
from jspec.loop.engine import SpeculativeDecoder  # noqa: E402
from jspec.loop.sharding import make_mesh  # noqa: E402

meshes = {"2x4": (2, 4)}
make_tree = mesh_script.QUICK["eagle3_tree"]
out = {
    "plain": mesh_script.run(lambda mesh: Decoder(mesh_script.target, mesh=mesh), meshes),
    "multi_process": make_mesh(2, 4).is_multi_process,
}
if "--with-tree" in sys.argv:
    out["eagle3_tree"] = mesh_script.run(lambda mesh: SpeculativeDecoder(mesh_script.target, make_tree(), mesh=mesh),
                                         meshes)  # fmt: skip
print(json.dumps(out))
