//! libibverbs backed by rdmad. A verbs program run through `rdmactl exec` (or with this
//! library's directory first on `LD_LIBRARY_PATH`) loads it in libibverbs's place: the
//! devices it lists are the ones rdmad serves, opening one opens an rdmad session on the
//! bus, and every resource the program creates is the daemon's, within its user's quotas.
//!
//! - [`abi`] is the C side: libibverbs's structures (generated from the installed
//!   `verbs.h`), the exported `ibv_*` functions with their symbol versions, and the verbs
//!   this library does not offer, which fail as libibverbs reports an unsupported verb.
//! - [`backend`] talks to rdmad: one bus connection per process, driven by a runtime of
//!   the library's own.
//! - [`maps`] reads the process's own mappings, which `ibv_reg_mr` checks before it
//!   re-backs a range with rdmad's memory.
//! - [`names`] holds the tables behind the string and rate helpers.
//!
//! docs/verbs.md says what is covered and how a program runs through it.

#[allow(unsafe_code)]
mod abi;
pub mod backend;
pub mod maps;
pub mod names;
