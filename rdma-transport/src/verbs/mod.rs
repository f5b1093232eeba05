//! Verbs (libibverbs) bindings and safe wrappers. Filled in by the RDMA issue.
