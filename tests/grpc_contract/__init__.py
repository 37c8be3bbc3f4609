"""Tests of the gRPC contract (protos/disagg.proto), its generated code and the hand-off codec."""
