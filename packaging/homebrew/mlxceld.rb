# A Homebrew formula for mlxceld, for a tap (brew tap OWNER/mlxceld; brew install mlxceld).
# Written by `make formula` (packaging/homebrew/formula.py) from mlxceld.rb.in: edit that.
#
# url is the sdist attached to the GitHub release (not the tag's archive, whose bytes
# differ), so sha256 is that of the file `make dist` built and the release published.
#
# The dependencies (mlx, mlx-lm, ...) are installed from PyPI wheels into the
# formula's own virtualenv. A formula for homebrew-core would list each of them
# as a `resource` instead (`brew update-python-resources mlxceld` writes them).
class Mlxceld < Formula
  include Language::Python::Virtualenv

  desc "Run large language models across a handful of machines, as a system service"
  homepage "https://github.com/mlxceld/mlxceld"
  url "https://github.com/mlxceld/mlxceld/releases/download/v0.1.0/mlxceld-0.1.0.tar.gz"
  sha256 "5bae9531796aeb2c13a9a6b930b3a346b9193a35c7fb01530e7557d6fa1e31df"
  license "MIT"
  head "https://github.com/mlxceld/mlxceld.git", branch: "main"

  depends_on "python@3.12"

  on_macos do
    depends_on arch: :arm64 # MLX runs on Apple silicon
  end

  def install
    virtualenv_create(libexec, "python3.12")
    system libexec/"bin/python", "-m", "pip", "install", "--no-cache-dir", buildpath
    bin.install_symlink libexec/"bin/mlxceld", libexec/"bin/mlxctl"

    man1.install "man/mlxctl.1"
    man5.install "man/mlxcel-cluster.toml.5"
    man8.install "man/mlxceld.8"
    generate_completions_from_executable(bin/"mlxctl", shell_parameter_format: :typer)

    (pkgshare/"examples").install "contrib/mlxceld.toml", "contrib/cluster"
  end

  # The service's config file: the example, with the state, the control socket and the log
  # under Homebrew's var. Written only when absent, so that an upgrade keeps the user's own.
  def post_install
    (var/"log").mkpath
    config = etc/"mlxceld/mlxceld.toml"
    return if config.exist?

    example = pkgshare/"examples/mlxceld.toml"
    text = example.read
    {
      "state_dir" => var/"lib/mlxceld",
      "socket"    => var/"run/mlxceld/mlxceld.sock",
      "log_file"  => var/"log/mlxceld.log",
    }.each do |key, path|
      next if text.sub!(/^# #{key} = .*$/, "#{key} = \"#{path}\"")

      odie "#{example} has no '# #{key} = ' line to set; #{config} was not written"
    end
    config.dirname.mkpath
    config.write text
  end

  def caveats
    <<~EOS
      `brew services start mlxceld` runs the daemon with the config file
        #{etc}/mlxceld/mlxceld.toml
      (written from the example on install when absent, kept on upgrade), which
      keeps its state in #{var}/lib/mlxceld, its log in
      #{var}/log/mlxceld.log and its control socket at
        #{var}/run/mlxceld/mlxceld.sock
      where mlxctl looks for it (or set MLXCELD_SOCKET to it).
      Example cluster TOMLs are in:
        #{opt_pkgshare}/examples
      Without a model in the config the daemon runs idle; serve one with:
        mlxctl serve MODEL_DIR
    EOS
  end

  service do
    run [opt_bin/"mlxceld", "--config", etc/"mlxceld/mlxceld.toml"]
    keep_alive successful_exit: false
    log_path var/"log/mlxceld.log"
    error_log_path var/"log/mlxceld.log"
    # At least the drain deadline: the router's 20 s stop timeout plus 5 s.
    stop_timeout 60
    process_type :interactive
  end

  test do
    assert_match version.to_s, shell_output("#{bin}/mlxceld --version")
    assert_match "Control the local mlxceld daemon", shell_output("#{bin}/mlxctl --help")
    # No daemon here: mlxctl says so with its own exit code (3).
    output = shell_output("#{bin}/mlxctl --socket #{testpath}/none.sock status 2>&1", 3)
    assert_match "mlxceld", output
  end
end
