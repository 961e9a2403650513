//! rdmad: a system daemon that owns the host's RDMA resources and lends them to local
//! processes over D-Bus. The binary is a thin shell over this library.
//!
//! Layers, top to bottom (nothing flows up): [`dbus`] → [`policy`] → [`engine`] →
//! [`provider`].
//!
//! No `unsafe` outside the verbs provider ([`provider::verbs`]) and one test of [`memory`]:
//! the shared memory the daemon maps is touched only through `rdmad_client::mapping`, which
//! holds the rest.

#![deny(unsafe_code)]

pub mod cli;
pub mod config;
pub mod dbus;
pub mod engine;
pub mod lock;
pub mod logging;
pub mod memory;
pub mod policy;
pub mod provider;
pub mod service;
pub mod test_hooks;
