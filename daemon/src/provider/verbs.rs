//! The verbs provider: real RDMA devices through libibverbs (`rdma-sys`).
