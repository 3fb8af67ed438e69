//! The end-to-end tests (in `tests/`): the real services on loopback, driven through the generated
//! gRPC clients and the real model servers. Their harness is `crates/testkit`.

#![forbid(unsafe_code)]
