"""TVM's RPC server for the fault tests, except that while loading its Nth
candidate it dies (SIGKILL to its whole process group: a crashed host) or
hangs (SIGSTOP: a frozen one), mid-candidate from the client's side.

    python tests/tuning/rpc_fault_server.py --tracker H:P --key K --port P --fault die|hang --at N --count-file F

Every candidate it loads is appended to the count file (sessions run in
forked processes, so the count lives on disk)."""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tracker", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--fault", choices=("die", "hang"), required=True)
    ap.add_argument("--at", type=int, required=True)
    ap.add_argument("--count-file", required=True)
    args = ap.parse_args()
    host, port = args.tracker.rsplit(":", 1)

    # Runs in the server's worker process (pickled by value: defined in
    # __main__), whose forked session processes call `_server_env`.
    def init(fault=args.fault, at=args.at, count_file=args.count_file):
        import os
        import signal

        import tvm.rpc.server as srv
        import tvm_ffi

        original = srv._server_env

        def server_env(load_library, work_path=None):
            temp = original(load_library, work_path)
            load = tvm_ffi.get_global_func("tvm.rpc.server.load_module")

            def load_module(name):
                with open(count_file, "a") as f:
                    f.write(name + "\n")
                with open(count_file) as f:
                    n = len(f.read().splitlines())
                if n >= at:
                    os.killpg(os.getpgid(0), signal.SIGKILL if fault == "die" else signal.SIGSTOP)
                return load(name)

            tvm_ffi.register_global_func("tvm.rpc.server.load_module", load_module, override=True)
            return temp

        srv._server_env = server_env

    from tvm import rpc

    server = rpc.Server("127.0.0.1", args.port, args.port + 1, key=args.key, tracker_addr=(host, int(port)),
                        server_init_callback=init)
    server.proc.join()


if __name__ == "__main__":
    main()
