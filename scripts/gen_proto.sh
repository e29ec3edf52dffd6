#!/usr/bin/env bash
# Regenerates pyhlo/schema/hlo_pb2.py from pyhlo/schema/hlo.proto.
# Needs grpcio-tools (pip install grpcio-tools); the generated file is committed.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -I pyhlo/schema --python_out=pyhlo/schema pyhlo/schema/hlo.proto
echo "wrote pyhlo/schema/hlo_pb2.py"
