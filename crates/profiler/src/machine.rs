//! Facts about the machine, read from the operating system (Linux `/proc` and `/sys`); a fact that cannot be
//! read is named as unknown rather than guessed.

use std::fs;

/// CPU model name, from `/proc/cpuinfo`.
#[must_use]
pub fn cpu_model() -> String {
    let info = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info
        .lines()
        .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim()))
        .unwrap_or("unknown CPU");
    let flags = info.lines().find_map(|l| l.strip_prefix("flags")).unwrap_or("");
    let isa: Vec<&str> = ["avx512f", "avx512_bf16", "amx_bf16", "avx2"]
        .into_iter()
        .filter(|f| flags.split_whitespace().any(|x| x == *f))
        .collect();
    if isa.is_empty() { model.to_string() } else { format!("{model} ({})", isa.join(", ")) }
}

/// Logical CPUs this process may use.
#[must_use]
pub fn cpu_threads() -> u32 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u32)
}

/// Host RAM in bytes (`MemTotal`), 0 if unknown.
#[must_use]
pub fn host_ram_bytes() -> u64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| {
                l.strip_prefix("MemTotal:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            })
        })
        .map_or(0, |kib| kib * 1024)
}

/// The NVIDIA driver version line from `/proc/driver/nvidia/version`, if present.
#[must_use]
pub fn nvidia_driver() -> Option<String> {
    let v = fs::read_to_string("/proc/driver/nvidia/version").ok()?;
    let line = v.lines().next()?;
    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Tue ..."
    line.split_whitespace()
        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
        .map(str::to_string)
}

/// The PCIe link of the first NVIDIA display/3D controller, from sysfs (`current_link_speed` × width).
#[must_use]
pub fn nvidia_pcie_link() -> Option<String> {
    for dev in fs::read_dir("/sys/bus/pci/devices").ok()?.flatten() {
        let p = dev.path();
        let read = |f: &str| fs::read_to_string(p.join(f)).map(|s| s.trim().to_string()).ok();
        let is_gpu = read("vendor").as_deref() == Some("0x10de")
            && read("class").is_some_and(|c| c.starts_with("0x0300") || c.starts_with("0x0302"));
        if is_gpu {
            let speed = read("current_link_speed")?;
            let width = read("current_link_width")?;
            return Some(format!("{speed} x{width}"));
        }
    }
    None
}
