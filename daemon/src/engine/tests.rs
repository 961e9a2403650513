use super::*;
use std::io::Write;

fn config_file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn loopback_engine_serves_one_device_with_a_pd() {
    let file = config_file("");
    let engine = Engine::start(
        Config::default(),
        file.path().to_owned(),
        Some(ProviderChoice::Loopback),
    )
    .unwrap();
    assert_eq!(engine.devices().len(), 1);
    let entry = engine.device("loopback0").unwrap();
    assert_eq!(entry.port, 1);
    assert_eq!(engine.provider_counts().pds, 1);
    assert_eq!(
        engine.status_line(),
        "Serving 1 device: loopback0 (loopback); 0 sessions, 0 regions"
    );
    match engine.device("mlx5_0") {
        Err(e @ EngineError::NoSuchDevice { .. }) => {
            assert_eq!(
                e.to_string(),
                "no device named \"mlx5_0\" (devices: loopback0)"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn reload_swaps_valid_config_and_keeps_old_on_error() {
    let mut file = config_file("[daemon]\nlog_level = \"info\"\n");
    let engine = Engine::start(
        Config::load(file.path()).unwrap(),
        file.path().to_owned(),
        Some(ProviderChoice::Loopback),
    )
    .unwrap();

    file.as_file_mut().set_len(0).unwrap();
    std::fs::write(file.path(), "[daemon]\nlog_level = \"debug\"\n").unwrap();
    let (new, restart) = engine.reload().unwrap();
    assert_eq!(new.daemon.log_level, crate::config::LogLevel::Debug);
    assert!(restart.is_empty());
    assert_eq!(engine.reload_count(), 1);

    std::fs::write(file.path(), "[daemon]\nlog_level = \"loud\"\n").unwrap();
    let err = engine.reload().unwrap_err();
    assert_eq!((err.line, err.key.as_str()), (2, "daemon.log_level"));
    assert_eq!(
        engine.config().daemon.log_level,
        crate::config::LogLevel::Debug
    );
    assert_eq!(engine.reload_count(), 1);

    std::fs::write(file.path(), "[[device]]\nname = \"loopback0\"\n").unwrap();
    let (_, restart) = engine.reload().unwrap();
    assert_eq!(restart, vec!["[[device]]".to_owned()]);
    assert_eq!(engine.reload_count(), 2);

    // A device or pool device the host does not have: the next start would refuse it.
    for (text, line, key) in [
        (
            "[quota.default]\nregions = 3\n\n[[device]]\nname = \"mlx5_0\"\n",
            5,
            "device[0].name",
        ),
        (
            "[[pool]]\nname = \"p\"\ncapacity = \"1MiB\"\nsize_classes = [\"4KiB\"]\n\
             device = \"mlx5_0\"\n",
            5,
            "pool[0].device",
        ),
    ] {
        std::fs::write(file.path(), text).unwrap();
        let err = engine.reload().unwrap_err();
        assert_eq!((err.line, err.key.as_str()), (line, key), "{err}");
        assert!(err.message.contains("\"mlx5_0\""), "{err}");
        assert_eq!(engine.reload_count(), 2);
        assert_eq!(engine.config().devices[0].name, "loopback0");
    }
}

#[test]
fn shutdown_releases_every_provider_object() {
    let engine = Engine::start(
        Config::default(),
        PathBuf::from("/dev/null"),
        Some(ProviderChoice::Loopback),
    )
    .unwrap();
    let device = Arc::clone(&engine.devices()[0].device);
    assert_eq!(device.object_counts().pds, 1);
    engine.shutdown();
    assert_eq!(device.object_counts(), ObjectCounts::default());
}

/// A queue pair whose session is closed while it is being created is not left to the
/// data-path worker, which would keep it (and its CQ) alive with no session. Found while
/// fuzzing the D-Bus surface (`tests/tests/fuzz_dbus.rs`); the race is swept by closing
/// the session a little later in every round.
#[test]
fn a_queue_pair_made_while_its_session_closes_is_released() {
    let engine = Arc::new(
        Engine::start(
            Config::default(),
            PathBuf::from("/dev/null"),
            Some(ProviderChoice::Loopback),
        )
        .unwrap(),
    );
    let owner = Owner {
        uid: 0,
        connection: ":1.1".into(),
        pid: None,
    };
    let limits = Limits::unlimited(0);
    let baseline = engine.provider_counts();
    // How long one creation takes, to spread the closings over it.
    let started = std::time::Instant::now();
    let session = engine.open_session(&owner, &limits).unwrap();
    drop(engine.create_qp(&owner, &limits, session, "loopback0", QpOptions::default()));
    let span = started.elapsed().max(std::time::Duration::from_micros(20));
    engine.close_session(&owner, Scope::Own, session).unwrap();
    let rounds = 3000u32;
    for round in 0..rounds {
        let session = engine.open_session(&owner, &limits).unwrap();
        let barrier = Arc::new(std::sync::Barrier::new(2));
        let closer = {
            let (engine, owner, barrier) =
                (Arc::clone(&engine), owner.clone(), Arc::clone(&barrier));
            let delay = span * round / rounds;
            std::thread::spawn(move || {
                barrier.wait();
                let until = std::time::Instant::now() + delay;
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
                engine.close_session(&owner, Scope::Own, session).unwrap();
            })
        };
        barrier.wait();
        drop(engine.create_qp(&owner, &limits, session, "loopback0", QpOptions::default()));
        closer.join().unwrap();
    }
    assert_eq!(engine.registry.qp_count(), 0);
    let after = engine.provider_counts();
    assert_eq!((after.qps, after.cqs), (baseline.qps, baseline.cqs));
}
