//! Two processes sharing registered memory through rdmad.
//!
//! ```text
//! share-region owner [POOL]     allocate a region, write a message, share it read-only,
//!                               print the key, and hold the region until stdin closes
//! share-region reader KEY       attach the region with the key and print the message
//! ```
//!
//! Both talk to the bus in `$RDMAD_BUS_ADDRESS` (default: the system bus).

use std::io::Read;
use std::os::fd::OwnedFd;

use rdmad_client::proxy::{ManagerProxy, Options, RegionProxy, SessionProxy};
use rdmad_client::RegionMapping;
use zbus::zvariant::Value;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let connection = rdmad_client::connect(None).await?;
    let manager = ManagerProxy::new(&connection).await?;
    let session_path = manager.open_session(Options::new()).await?;
    let session = SessionProxy::builder(&connection)
        .path(session_path)?
        .build()
        .await?;

    match args.get(1).map(String::as_str) {
        Some("owner") => {
            let pool = args.get(2).map_or("default", String::as_str);
            let (path, fd, size) = session.allocate_region(pool, 4096, Options::new()).await?;
            let mapping = RegionMapping::map(OwnedFd::from(fd), size as usize, true)?;
            let message = format!("hello from pid {} through rdmad", std::process::id());
            mapping.write(0, message.as_bytes())?;
            let region = RegionProxy::builder(&connection)
                .path(path.clone())?
                .build()
                .await?;
            let mut options = Options::new();
            options.insert("access", Value::from("ro"));
            let (key, _) = region.share(options).await?;
            eprintln!(
                "owner: region {} ({size} bytes) holds {message:?}",
                path.as_str()
            );
            println!("{key}");
            // Hold the session (and so the region) until told to stop.
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
            region.free().await?;
            eprintln!("owner: region freed");
        }
        Some("reader") => {
            let key = args.get(2).ok_or("usage: share-region reader KEY")?;
            let (path, fd, size, access) = session.attach_region(key, Options::new()).await?;
            let fd = OwnedFd::from(fd);
            let writable = RegionMapping::map(fd.try_clone()?, size as usize, true);
            let mapping = RegionMapping::map(fd, size as usize, false)?;
            let mut buf = vec![0u8; 64];
            mapping.read(0, &mut buf)?;
            let text = String::from_utf8_lossy(&buf);
            println!(
                "reader: attached {} ({access}): {:?}",
                path.as_str(),
                text.trim_end_matches('\0')
            );
            println!(
                "reader: mapping it writable: {}",
                match writable {
                    Ok(_) => "allowed".to_owned(),
                    Err(e) => format!("refused ({e})"),
                }
            );
        }
        _ => {
            eprintln!("usage: share-region owner [POOL] | share-region reader KEY");
            std::process::exit(2);
        }
    }
    Ok(())
}
