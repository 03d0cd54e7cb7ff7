//! Progress bars for loads that take more than a second, on a terminal only.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressFinish, ProgressStyle};

/// A progress bar on stderr for work that may take more than a second: drawn only when stderr
/// is a terminal, and only once the work has gone on for a second, so quick loads and logs
/// show nothing. `template` is indicatif's (`{msg}`, `{bar:30}`, `{pos}`, `{len}`,
/// `{bytes}`, `{elapsed}`, ...). Dropping the bar clears it.
pub fn bar(len: u64, template: &str, msg: String) -> ProgressBar {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::hidden())
        .with_finish(ProgressFinish::AndClear)
        .with_style(
            ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
        )
        .with_message(msg);
    let weak = pb.downgrade();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(1));
        if let Some(pb) = weak.upgrade().filter(|pb| !pb.is_finished()) {
            pb.set_draw_target(ProgressDrawTarget::stderr());
            pb.enable_steady_tick(Duration::from_millis(200));
        }
    });
    pb
}
