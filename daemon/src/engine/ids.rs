//! The ids of what the engine holds, one type each, so a session's id never passes where a
//! region's is wanted. Each shows as its number (`Display` and `Debug`), as in object paths and logs.

use std::fmt;

macro_rules! id {
    ($(#[$doc:meta] $name:ident),* $(,)?) => {$(
        #[$doc]
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        /// As the number, as logs have always shown it (`sessions=[5]`).
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl $name {
            /// The id after this one (ids are handed out in order, never reused).
            pub(crate) fn next(self) -> $name {
                $name(self.0 + 1)
            }
        }
    )*};
}

id!(
    /// A session (`/org/rdmad1/session/<n>`).
    SessionId,
    /// A region (`/org/rdmad1/region/<n>`).
    RegionId,
    /// An access key (`Region.Share` returns it with the token).
    KeyId,
    /// A queue pair (`/org/rdmad1/qp/<n>`).
    QpId,
    /// An export of a region through a queue pair.
    ExportId,
    /// A registration of part of a region in a protection domain of its session's.
    RegistrationId,
    /// A protection domain of a session's own, unique in the daemon's life.
    DomainId,
    /// A session's listener for connections by address (`Session.Listen`).
    ListenerId,
);
