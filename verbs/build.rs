//! Generates the libibverbs ABI types from the installed `<infiniband/verbs.h>` and
//! `<infiniband/sa.h>` (Debian's `libibverbs-dev`) and the kernel's forms of the
//! structures librdmacm converts (`<rdma/ib_user_verbs.h>`, `<rdma/ib_user_sa.h>`), and
//! links the library under libibverbs's soname with its version nodes (`libibverbs.map`;
//! the symbols get their versions from `.symver` directives in `src/abi/`).

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let map = manifest.join("libibverbs.map");
    println!("cargo:rerun-if-changed={}", map.display());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );

    link_into_target_dir();

    let bindings = bindgen::Builder::default()
        .header_contents(
            "verbs-abi.h",
            "#include <infiniband/verbs.h>\n#include <infiniband/sa.h>\n\
             #include <rdma/ib_user_verbs.h>\n#include <rdma/ib_user_sa.h>\n",
        )
        .allowlist_type("ibv_.*")
        // The kernel's forms of QP attributes, address vectors and path records, which
        // librdmacm hands to `ibv_copy_*_from_kern`.
        .allowlist_type("ib_uverbs_qp_attr|ib_uverbs_ah_attr|ib_user_path_rec")
        .allowlist_var("IBV_.*")
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .generate()
        .expect("cannot generate the verbs ABI from <infiniband/verbs.h>: install libibverbs-dev");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("verbs_abi.rs");
    bindings.write_to_file(out).expect("write verbs_abi.rs");
}

/// Links `rdmad-verbs/libibverbs.so.1` → `../librdmad_verbs.so` in the profile's target
/// directory (next to `rdmactl`), so that `rdmactl exec` from a build tree finds the
/// library under the name programs load. The link dangles until the library is linked.
fn link_into_target_dir() {
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
    let Some(profile_dir) = out.ancestors().nth(3) else {
        return;
    };
    let dir = profile_dir.join("rdmad-verbs");
    let link = dir.join("libibverbs.so.1");
    if std::fs::create_dir_all(&dir).is_ok() && std::fs::symlink_metadata(&link).is_err() {
        let _ = std::os::unix::fs::symlink("../librdmad_verbs.so", &link);
    }
}
