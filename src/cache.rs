//! Atlas's cache directory and how its directories are made: the lowest layer, used by the GPU
//! backends (compiled kernels) and by the engine and tools (the default model).

use std::path::{Path, PathBuf};

/// Atlas's cache directory (the default model, compiled GPU kernels), always absolute:
/// `$ATLAS_CACHE` (made absolute); on Windows `%LOCALAPPDATA%\atlas`, else
/// `%USERPROFILE%\AppData\Local\atlas`; elsewhere `$XDG_CACHE_HOME/atlas`, else `~/.cache/atlas`.
/// None when no such variable names an absolute directory: a library loaded into a host must not
/// write into the host's current directory.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|name| std::env::var_os(name), cfg!(windows))
}

fn cache_dir_from(var: impl Fn(&str) -> Option<std::ffi::OsString>, windows: bool) -> Option<PathBuf> {
    if let Some(dir) = var("ATLAS_CACHE").filter(|v| !v.is_empty()) {
        return std::path::absolute(dir).ok();
    }
    let absolute = |name: &str| var(name).map(PathBuf::from).filter(|p| p.is_absolute());
    let base = if windows {
        absolute("LOCALAPPDATA").or_else(|| absolute("USERPROFILE").map(|home| home.join("AppData").join("Local")))
    } else {
        absolute("XDG_CACHE_HOME").or_else(|| absolute("HOME").map(|home| home.join(".cache")))
    };
    base.map(|dir| dir.join("atlas"))
}

/// Makes `dir` and any missing parents as the cache wants them: 0700 on Unix (only the user may
/// read, write or enter them); directories that exist already are left as they are.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache_with(vars: &[(&str, &str)], windows: bool) -> Option<PathBuf> {
        cache_dir_from(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| (*v).into()), windows)
    }

    /// %LOCALAPPDATA%\atlas on Windows, the XDG cache elsewhere; never a relative directory.
    #[test]
    fn the_cache_is_an_absolute_directory_or_none() {
        let root = std::env::temp_dir();
        let (local, home) = (root.join("Local AppData é"), root.join("home"));
        let (local_s, home_s) = (local.to_str().unwrap(), home.to_str().unwrap());
        assert_eq!(cache_with(&[("LOCALAPPDATA", local_s), ("HOME", home_s)], true), Some(local.join("atlas")));
        assert_eq!(cache_with(&[("USERPROFILE", home_s)], true), Some(home.join("AppData").join("Local").join("atlas")));
        assert_eq!(cache_with(&[("LOCALAPPDATA", "relative"), ("HOME", home_s)], true), None);
        assert_eq!(cache_with(&[("HOME", home_s)], false), Some(home.join(".cache").join("atlas")));
        assert_eq!(cache_with(&[("XDG_CACHE_HOME", "rel"), ("HOME", home_s)], false), Some(home.join(".cache").join("atlas")));
        assert_eq!(cache_with(&[("HOME", ".")], false), None);
        assert_eq!(cache_with(&[], false), None);
        assert_eq!(cache_with(&[], true), None);
        let explicit = cache_with(&[("ATLAS_CACHE", "cache dir"), ("HOME", home_s)], false).unwrap();
        assert!(explicit.is_absolute() && explicit.ends_with("cache dir"), "{}", explicit.display());
    }
}
