//! GPU kernel pieces emulated on the CPU (no GPU needed): the tiled expert kernels' weight loader
//! (`te_load_w8` in kernels.cu, scripts/tiled-experts-emu) against the per-element dequantisation. Skips
//! where g++ is missing.

use std::path::Path;
use std::process::Command;

/// q8_0, q4_0, q4_K and q6_K: the loader's eight-value paths give the per-element dequantisation rounded to
/// bf16 and to f16, bit for bit, over random blocks at every offset.
#[test]
fn tiled_weight_loader_matches_the_per_element_dequantisation() {
    if Command::new("g++").arg("--version").output().is_err() {
        eprintln!("skipped: no g++");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("bash")
        .arg("scripts/tiled-experts-emu/run.sh")
        .current_dir(&root)
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.matches("bit-identical").count(), 8, "{stdout}");
}
