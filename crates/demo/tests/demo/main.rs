//! The `demo` binary: the whole loop on the stand-in model, and against real model servers.

mod model_servers;
mod process;
