//! Turns per user for calls that hold a blocking thread for as long as something outside
//! the daemon takes — a peer answering rdma_cm, a queue pair's send queue reaching a
//! window bind — so that one user's calls that never end cannot take the threads every
//! client's calls run on. A call waits for its turn without holding a thread.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rdmad_client::Error;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Connections by address one user may have under way at once.
pub const CONNECTING_PER_USER: usize = 4;

/// Window binds and invalidations (`Region.ExportRemote`, `Region.ReleaseExport`) one user
/// may have waiting for its queue pairs at once.
pub const WINDOW_WORK_PER_USER: usize = 4;

/// One kind of call's turns, per user.
#[derive(Debug)]
pub struct Turns {
    per_user: usize,
    by_uid: Mutex<HashMap<u32, Arc<Semaphore>>>,
}

impl Turns {
    /// `per_user` turns for each user.
    pub fn new(per_user: usize) -> Turns {
        Turns {
            per_user,
            by_uid: Mutex::default(),
        }
    }

    /// Waits (asynchronously) for one of `uid`'s turns.
    pub async fn take(&self, uid: u32) -> Result<OwnedSemaphorePermit, Error> {
        let turns = {
            let mut map = self.by_uid.lock().unwrap_or_else(|e| e.into_inner());
            Arc::clone(
                map.entry(uid)
                    .or_insert_with(|| Arc::new(Semaphore::new(self.per_user))),
            )
        };
        turns
            .acquire_owned()
            .await
            .map_err(|e| Error::DeviceError(format!("internal error: {e}")))
    }
}
