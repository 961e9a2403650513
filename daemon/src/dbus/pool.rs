//! `/org/rdmad1/pool/<name>`, interface `org.rdmad1.Pool`: capacity and live use.

use std::sync::Arc;

use zbus::interface;

use crate::engine::Pool;

pub struct PoolObject {
    pool: Arc<Pool>,
}

impl PoolObject {
    pub fn new(pool: Arc<Pool>) -> PoolObject {
        PoolObject { pool }
    }
}

#[interface(name = "org.rdmad1.Pool")]
impl PoolObject {
    #[zbus(property(emits_changed_signal = "const"))]
    async fn name(&self) -> String {
        self.pool.name().to_owned()
    }

    /// The device whose protection domain registers the pool's regions.
    #[zbus(property(emits_changed_signal = "const"))]
    async fn device(&self) -> String {
        self.pool.device.clone()
    }

    #[zbus(property(emits_changed_signal = "const"))]
    async fn capacity(&self) -> u64 {
        self.pool.config.capacity.0
    }

    /// Region sizes (empty for a pool with a granularity).
    #[zbus(property(emits_changed_signal = "const"))]
    async fn size_classes(&self) -> Vec<u64> {
        self.pool.config.size_classes.iter().map(|c| c.0).collect()
    }

    /// Bytes of regions handed out.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn used(&self) -> u64 {
        self.pool.stats().used
    }

    /// Bytes neither handed out nor warm.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn free(&self) -> u64 {
        self.pool.stats().free
    }

    #[zbus(property(emits_changed_signal = "false"), name = "NRegions")]
    async fn n_regions(&self) -> u64 {
        self.pool.stats().regions
    }

    /// Fresh registered regions ready to hand out.
    #[zbus(property(emits_changed_signal = "false"))]
    async fn warm_regions(&self) -> u64 {
        self.pool.stats().warm_regions
    }
}
