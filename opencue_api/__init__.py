"""OpenCue's own clients (pycue, cueadmin, cueman, pyoutline, CueGUI) speak Cuebot's gRPC protocol to this."""
