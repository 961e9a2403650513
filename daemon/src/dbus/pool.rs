//! `/org/rdmad1/pool/<name>`, interface `org.rdmad1.Pool`: capacity and live use.

use std::sync::Arc;

use zbus::interface;

use super::context::settled;
use crate::engine::{Engine, PoolSnapshot};

pub struct PoolObject {
    engine: Arc<Engine>,
    name: String,
}

impl PoolObject {
    pub fn new(engine: Arc<Engine>, name: String) -> PoolObject {
        PoolObject { engine, name }
    }

    fn snapshot(&self) -> zbus::fdo::Result<PoolSnapshot> {
        self.engine
            .pool_snapshot(&self.name)
            .map_err(|e| zbus::fdo::Error::Failed(e.to_string()))
    }
}

#[interface(name = "org.rdmad1.Pool")]
impl PoolObject {
    #[zbus(property(emits_changed_signal = "const"))]
    async fn name(&self) -> String {
        self.name.clone()
    }

    /// The device whose protection domain registers the pool's regions.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn device(&self) -> zbus::fdo::Result<String> {
        Ok(self.snapshot()?.device)
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn capacity(&self) -> zbus::fdo::Result<u64> {
        Ok(self.snapshot()?.config.capacity.0)
    }

    /// Region sizes (empty for a pool with a granularity).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn size_classes(&self) -> zbus::fdo::Result<Vec<u64>> {
        Ok(self
            .snapshot()?
            .config
            .size_classes
            .iter()
            .map(|c| c.0)
            .collect())
    }

    /// Bytes of regions handed out.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn used(&self) -> zbus::fdo::Result<u64> {
        settled(&self.engine).await;
        Ok(self.snapshot()?.stats.used)
    }

    /// Bytes neither handed out nor warm.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn free(&self) -> zbus::fdo::Result<u64> {
        settled(&self.engine).await;
        Ok(self.snapshot()?.stats.free)
    }

    #[zbus(property(emits_changed_signal = "false"), name = "NRegions")]
    async fn n_regions(&self) -> zbus::fdo::Result<u64> {
        settled(&self.engine).await;
        Ok(self.snapshot()?.stats.regions)
    }

    /// Fresh registered regions ready to hand out.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn warm_regions(&self) -> zbus::fdo::Result<u64> {
        settled(&self.engine).await;
        Ok(self.snapshot()?.stats.warm_regions)
    }
}
