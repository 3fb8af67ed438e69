//! The house, checked against itself: layout and file-level cycles, the claims the docs make, the
//! proto reference, the configuration reference, the contracts under buf, and the Kubernetes
//! manifests.

mod contract;
mod deploy;
mod docs_claims;
mod layout;
mod module_graph;
mod proto_docs;
mod readme_flags;
