"""The `lorafleet` command line: clients of both planes, and `lorafleet up`."""

import os

# gRPC's C core registers fork handlers unless told not to. In a child forked to run a preexec_fn (`lorafleet
# up` sets PR_SET_PDEATHSIG in one) they restart gRPC's poller, which then finds its epoll descriptor closed
# by close_fds and aborts the child before it can exec: seen as `up`'s router exiting with SIGABRT and
# "epoll_wait error: Bad file descriptor" on a loaded machine. No process here uses gRPC across a fork.
# Set before anything imports grpc, which reads it once.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
