//! A memory pool: regions of fixed size classes (or a granularity), each its own memfd
//! registered on the pool's device, plus a warm set of fresh, never-exposed registered
//! regions per class that a background thread keeps full. Regions are never recycled: a
//! freed region is deregistered and dropped, and only its capacity returns.

use std::sync::{Arc, Condvar, Mutex};

use crate::config::{ByteSize, PoolConfig};
use crate::lock::lock;
use crate::memory::SharedMemory;
use crate::provider::{Access, MemoryRegion, ProtectionDomain, ProviderError};

/// What a region's registration allows: local writes by the device, and binding memory
/// windows for remote access (remote rights come only through windows).
pub const REGION_ACCESS: Access = Access::LOCAL_WRITE.union(Access::MW_BIND);

#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(
        "pool {pool:?} has no size for {size} bytes: the largest region it serves is {largest}"
    )]
    TooLarge {
        pool: String,
        size: u64,
        largest: ByteSize,
    },
    #[error("a region must be at least one byte long")]
    Empty,
    #[error(
        "pool {pool:?} is full: {size} bytes requested, {free} of {capacity} free \
         (raise pool.capacity or free regions)"
    )]
    Exhausted {
        pool: String,
        size: u64,
        free: u64,
        capacity: ByteSize,
    },
    #[error("pool {pool:?}: cannot create a region: {source}")]
    Memory {
        pool: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Provider(#[from] ProviderError),
}

/// Counts shown on the pool's D-Bus object and by `rdmactl pool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolStats {
    pub capacity: u64,
    /// Bytes of regions handed out.
    pub used: u64,
    /// Bytes of warm regions (registered, never exposed).
    pub warm_bytes: u64,
    pub warm_regions: u64,
    /// Regions handed out.
    pub regions: u64,
    /// capacity − used − warm − being created.
    pub free: u64,
}

#[derive(Debug, Default)]
struct PoolState {
    used: u64,
    regions: u64,
    /// Bytes reserved for regions being created (warm or on demand).
    in_flight: u64,
    /// Warm regions per size class, in the order of `config.size_classes`.
    warm: Vec<Vec<Arc<dyn MemoryRegion>>>,
}

impl PoolState {
    fn warm_bytes(&self) -> u64 {
        self.warm.iter().flatten().map(|r| r.len() as u64).sum()
    }

    fn committed(&self) -> u64 {
        self.used + self.in_flight + self.warm_bytes()
    }
}

#[derive(Debug)]
pub struct Pool {
    pub config: PoolConfig,
    /// The device whose PD registers this pool's regions.
    pub device: String,
    pd: Arc<dyn ProtectionDomain>,
    state: Mutex<PoolState>,
    /// Wakes the refill thread.
    pub(super) refill: Arc<Refill>,
}

/// Shared by all pools and the refill thread.
#[derive(Debug, Default)]
pub struct Refill {
    pub(super) wanted: Mutex<RefillState>,
    pub(super) wake: Condvar,
}

#[derive(Debug, Default)]
pub(super) struct RefillState {
    pub(super) pending: bool,
    pub(super) stop: bool,
}

impl Refill {
    pub fn poke(&self) {
        lock(&self.wanted).pending = true;
        self.wake.notify_all();
    }
}

/// A region taken from a pool: registered memory and the size the pool charged.
#[derive(Debug)]
pub struct Allocation {
    pub mr: Arc<dyn MemoryRegion>,
    /// Whether it came from the warm set.
    pub warm: bool,
}

impl Pool {
    pub fn new(
        config: PoolConfig,
        device: String,
        pd: Arc<dyn ProtectionDomain>,
        refill: Arc<Refill>,
    ) -> Pool {
        let classes = config.size_classes.len();
        Pool {
            config,
            device,
            pd,
            state: Mutex::new(PoolState {
                warm: vec![Vec::new(); classes],
                ..PoolState::default()
            }),
            refill,
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The size a request gets.
    pub fn round(&self, size: u64) -> Result<u64, PoolError> {
        if size == 0 {
            return Err(PoolError::Empty);
        }
        self.config.round(size).ok_or_else(|| PoolError::TooLarge {
            pool: self.config.name.clone(),
            size,
            largest: ByteSize(self.config.largest()),
        })
    }

    /// Takes a region of (rounded) `size` bytes: from the warm set if one is ready, else
    /// freshly created and registered. The caller has already checked quotas.
    pub fn allocate(&self, size: u64) -> Result<Allocation, PoolError> {
        let size = self.round(size)?;
        {
            let mut state = lock(&self.state);
            if let Some(mr) = self.pop_warm(&mut state, size) {
                drop(state);
                self.refill.poke();
                return Ok(Allocation { mr, warm: true });
            }
            self.reserve(&mut state, size)?;
        }
        let created = self.create(size);
        let mut state = lock(&self.state);
        state.in_flight -= size;
        let mr = created?;
        state.used += size;
        state.regions += 1;
        drop(state);
        // A cold allocation means the warm set ran dry.
        self.refill.poke();
        Ok(Allocation { mr, warm: false })
    }

    /// Takes a warm region of (rounded) `size` bytes if one is ready, `None` if not: never
    /// makes one, so it never waits for the device. The caller has already checked quotas.
    pub fn take_warm(&self, size: u64) -> Result<Option<Allocation>, PoolError> {
        let size = self.round(size)?;
        let mr = self.pop_warm(&mut lock(&self.state), size);
        Ok(mr.map(|mr| {
            self.refill.poke();
            Allocation { mr, warm: true }
        }))
    }

    /// A warm region of the class of `size` (already rounded), counted as used.
    fn pop_warm(&self, state: &mut PoolState, size: u64) -> Option<Arc<dyn MemoryRegion>> {
        let mr = state.warm[self.class_of(size)?].pop()?;
        state.used += size;
        state.regions += 1;
        Some(mr)
    }

    /// Returns a freed region's capacity. The region itself is dropped by its owner.
    pub fn release(&self, size: u64) {
        let mut state = lock(&self.state);
        state.used = state.used.saturating_sub(size);
        state.regions = state.regions.saturating_sub(1);
        drop(state);
        self.refill.poke();
    }

    pub fn stats(&self) -> PoolStats {
        let state = lock(&self.state);
        let warm_bytes = state.warm_bytes();
        PoolStats {
            capacity: self.config.capacity.0,
            used: state.used,
            warm_bytes,
            warm_regions: state.warm.iter().map(|w| w.len() as u64).sum(),
            regions: state.regions,
            free: self.config.capacity.0.saturating_sub(state.committed()),
        }
    }

    /// Creates one missing warm region, if any is missing and fits; returns whether it
    /// did something (the refill thread calls it until it returns false).
    pub fn refill_one(&self) -> bool {
        let (class, size) = {
            let mut state = lock(&self.state);
            let target = self.config.warm as usize;
            let Some(class) = (0..state.warm.len()).find(|&c| state.warm[c].len() < target) else {
                return false;
            };
            let size = self.config.size_classes[class].0;
            // The warm set never crowds out allocations: it only fills free capacity.
            if self.reserve(&mut state, size).is_err() {
                return false;
            }
            (class, size)
        };
        let created = self.create(size);
        let mut state = lock(&self.state);
        state.in_flight -= size;
        match created {
            Ok(mr) => {
                state.warm[class].push(mr);
                true
            }
            Err(e) => {
                tracing::warn!(pool = self.name(), "cannot refill the warm set: {e}");
                false
            }
        }
    }

    /// Whether every size class has its `warm` regions ready.
    pub fn warm_full(&self) -> bool {
        let target = self.config.warm as usize;
        lock(&self.state).warm.iter().all(|w| w.len() >= target)
    }

    /// Drops the warm set (shutdown).
    pub fn drain(&self) {
        let warm = std::mem::take(&mut lock(&self.state).warm);
        drop(warm);
    }

    fn class_of(&self, size: u64) -> Option<usize> {
        self.config.size_classes.iter().position(|c| c.0 == size)
    }

    fn reserve(&self, state: &mut PoolState, size: u64) -> Result<(), PoolError> {
        let capacity = self.config.capacity.0;
        let committed = state.committed();
        if committed + size > capacity {
            return Err(PoolError::Exhausted {
                pool: self.config.name.clone(),
                size,
                free: capacity.saturating_sub(committed),
                capacity: self.config.capacity,
            });
        }
        state.in_flight += size;
        Ok(())
    }

    fn create(&self, size: u64) -> Result<Arc<dyn MemoryRegion>, PoolError> {
        let len = usize::try_from(size).map_err(|_| PoolError::TooLarge {
            pool: self.config.name.clone(),
            size,
            largest: ByteSize(self.config.largest()),
        })?;
        let memory = SharedMemory::create_with(c"rdmad-region", len, self.config.hugepages)
            .map_err(|source| PoolError::Memory {
                pool: self.config.name.clone(),
                source,
            })?;
        Ok(self.pd.register(Arc::new(memory), REGION_ACCESS)?)
    }
}

/// The background thread that keeps every pool's warm set full.
pub fn spawn_refill_thread(
    pools: Vec<Arc<Pool>>,
    refill: Arc<Refill>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let started = std::time::Instant::now();
    let mut announced = false;
    std::thread::Builder::new()
        .name("rdmad-refill".into())
        .spawn(move || loop {
            {
                let mut wanted = lock(&refill.wanted);
                while !wanted.pending && !wanted.stop {
                    wanted = refill
                        .wake
                        .wait(wanted)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                if wanted.stop {
                    return;
                }
                wanted.pending = false;
            }
            for pool in &pools {
                while pool.refill_one() {
                    if lock(&refill.wanted).stop {
                        return;
                    }
                }
            }
            // Once after start: from here on, allocations are served warm.
            if !announced && pools.iter().all(|p| p.warm_full()) {
                announced = true;
                let regions: u64 = pools.iter().map(|p| p.stats().warm_regions).sum();
                tracing::info!(
                    regions,
                    elapsed = ?started.elapsed(),
                    "warm sets filled"
                );
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::loopback::LoopbackDevice;
    use crate::provider::Device;

    fn pool(text: &str) -> (LoopbackDevice, Pool) {
        let config: crate::config::Config =
            crate::config::Config::parse(std::path::Path::new("t.toml"), text).unwrap();
        let dev = LoopbackDevice::new("lo-pool");
        let pd = dev.alloc_pd().unwrap();
        let pool = Pool::new(
            config.pools[0].clone(),
            "lo-pool".into(),
            pd,
            Arc::default(),
        );
        (dev, pool)
    }

    const CLASSES: &str = "[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\n\
                           size_classes = [\"4KiB\", \"64KiB\", \"512KiB\"]\nwarm = 1\n";

    #[test]
    fn sizes_round_up_to_classes_and_too_large_is_refused() {
        let (_dev, pool) = pool(CLASSES);
        assert_eq!(pool.round(1).unwrap(), 4096);
        assert_eq!(pool.round(4097).unwrap(), 65536);
        let err = pool.allocate(512 * 1024 + 1).unwrap_err().to_string();
        assert_eq!(
            err,
            "pool \"p\" has no size for 524289 bytes: the largest region it serves is 512KiB"
        );
        assert!(matches!(pool.allocate(0), Err(PoolError::Empty)));
    }

    #[test]
    fn warm_set_fills_within_capacity_and_serves_first() {
        let (dev, pool) = pool(CLASSES);
        while pool.refill_one() {}
        let stats = pool.stats();
        assert_eq!(
            (stats.warm_regions, stats.warm_bytes),
            (3, 4096 + 65536 + 524288)
        );
        assert_eq!(dev.object_counts().mrs, 3);

        let a = pool.allocate(100).unwrap();
        assert!(a.warm);
        assert_eq!(a.mr.len(), 4096);
        assert_eq!(a.mr.access(), REGION_ACCESS);
        let b = pool.allocate(100).unwrap();
        assert!(!b.warm, "the warm set had one region of that class");
        let stats = pool.stats();
        assert_eq!(
            (stats.used, stats.regions, stats.warm_regions),
            (8192, 2, 2)
        );
        assert_eq!(stats.free, (1 << 20) - 8192 - 65536 - 524288);

        pool.release(4096);
        drop(a);
        assert_eq!(pool.stats().used, 4096);
        assert_eq!(dev.object_counts().mrs, 3, "a freed region is deregistered");
    }

    #[test]
    fn capacity_is_never_exceeded() {
        let (_dev, pool) = pool(CLASSES);
        let mut held = Vec::new();
        loop {
            match pool.allocate(512 * 1024) {
                Ok(a) => held.push(a),
                Err(PoolError::Exhausted { free, .. }) => {
                    assert!(free < 512 * 1024);
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(held.len(), 2);
        assert!(!pool.refill_one(), "no capacity left for warm regions");
        let message = pool.allocate(4096);
        assert!(message.is_err());
    }

    #[test]
    fn fresh_regions_read_as_zero() {
        let (_dev, pool) = pool(CLASSES);
        while pool.refill_one() {}
        for size in [4096, 65536, 524288] {
            for _ in 0..2 {
                let a = pool.allocate(size).unwrap();
                let mut buf = vec![0xaau8; size as usize];
                a.mr.memory().read_at(0, &mut buf).unwrap();
                assert!(buf.iter().all(|&b| b == 0));
                a.mr.memory().write_at(0, b"dirty").unwrap();
                pool.release(size);
            }
        }
    }

    #[test]
    fn granularity_pools_round_to_multiples() {
        let (_dev, pool) =
            pool("[[pool]]\nname = \"g\"\ncapacity = \"64KiB\"\ngranularity = \"8KiB\"\n");
        assert_eq!(pool.round(1).unwrap(), 8192);
        assert_eq!(pool.round(8193).unwrap(), 16384);
        assert!(pool.round(65537).is_err());
        let a = pool.allocate(20000).unwrap();
        assert_eq!(a.mr.len(), 24576);
    }
}
