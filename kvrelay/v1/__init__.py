"""Generated gRPC/protobuf code for package kvrelay.v1 (scripts/gen_protos.sh). Do not edit."""
