//! rdmad: a system daemon that owns the host's RDMA resources and lends them to local
//! processes over D-Bus. The binary is a thin shell over this library.
//!
//! Layers, top to bottom (nothing flows up): [`dbus`] → [`policy`] → [`engine`] →
//! [`provider`]. The D-Bus layer asks the policy layer to turn each caller into plain
//! inputs (an owner, the limits in force, a scope, pool access) and calls the engine's one
//! face, [`engine::Engine`], with them; the engine's submodules are private, and it never
//! sees a caller. [`config`], [`memory`] and [`lock`] serve every layer; [`service`] is the
//! top, starting the engine and serving the bus. `docs/architecture.md` has the imports each
//! layer may make, the threads and the drop order.
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

/// One body, two tests: `NAME` on the loopback device and `rxe_NAME` on Soft-RoCE (the VM
/// tier runs `rxe_*`). The bodies live in a module `bodies` of the calling file.
///
/// - `on_both_providers!(async a / rxe_a, …)`: the bodies are `async fn a(provider: &str)`,
///   given `"loopback"` or `"verbs"` (the daemon's `--provider`), run on tokio's
///   multi-threaded runtime (the integration tests of `rdmad-tests`).
/// - `on_both_providers!(a / rxe_a, …)`: the bodies are `fn a(provider: ProviderChoice)`
///   (the engine's unit tests).
#[macro_export]
macro_rules! on_both_providers {
    (async $($name:ident / $rxe:ident),* $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread")]
        async fn $name() {
            bodies::$name("loopback").await
        }
        #[tokio::test(flavor = "multi_thread")]
        async fn $rxe() {
            bodies::$name("verbs").await
        }
    )*};
    ($($name:ident / $rxe:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            bodies::$name($crate::config::ProviderChoice::Loopback)
        }
        #[test]
        fn $rxe() {
            bodies::$name($crate::config::ProviderChoice::Verbs)
        }
    )*};
}
