//! The data path: clients' work requests arrive through shared-memory rings, are copied
//! out, checked and translated (`validate`), and posted to the device by a worker per
//! device; completions go back the same way.

pub mod rights;
mod served;
#[cfg(test)]
pub(super) mod tests;
pub mod validate;
pub mod wakeup;
pub mod worker;
