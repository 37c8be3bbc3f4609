"""Generated Python code of the gRPC contract ``protos/disagg.proto`` (package ``disagg``).

- ``disagg_pb2`` (+ ``.pyi``): the messages ``PreFillRequest``, ``KVBlock``, ``KVBlockStream``,
  ``DecodeRequest``, ``TokenStream``.
- ``disagg_pb2_grpc`` (+ ``.pyi``): ``PrefillWorkerStub``/``Servicer`` and
  ``DecodeWorkerStub``/``Servicer``, ``add_*Servicer_to_server``.

Never edit the generated modules: change the proto and run ``python -m sidecar.tools.grpc_regen``
(``tests/grpc_contract`` fails when they are stale). Nothing is imported here, so importing
the package does not register the descriptors.
"""
